"""What the test suite shares: the simulated machine, installs on it, the admin side, real
accounts, fault injection, and waiting for and reaping processes (docs/development.md)."""
