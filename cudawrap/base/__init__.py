"""Process-level helpers every layer may use: safe paths, root-owned files, privilege, inotify, audit, daemons."""
