/* The trivial program whose launch the benchmark times: it exits at once. */
int main(void) { return 0; }
