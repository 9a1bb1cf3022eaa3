"""The shim's template, shipped as package data (``cudawrap.shims``); no code lives here."""
