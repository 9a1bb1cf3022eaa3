"""Process-level pieces every layer may use: /proc (proc, procinfo), users, text, safe paths, root-owned files,
file stamps, privilege, inotify, audit, daemons, cgroups and device rules, a user's terminal."""
