"""Wrapping programs and checking them: wrap/unwrap, inspection, dpkg-divert, doctor."""
