from metatrace.cli import entry

entry()
