"""Written by tools/release.py: the lockstep-exact release this plugin was built against."""

EXACT_VERSION = "0.1.0"
