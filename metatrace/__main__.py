"""The `metatrace` command and `python -m metatrace`: Ctrl-C handled before anything else is
imported (metatrace.interrupt), then the command line (metatrace.cli)."""

from metatrace.interrupt import quiet_interrupts


def entry() -> None:
    quiet_interrupts()
    from metatrace.cli import entry as command

    command()


if __name__ == "__main__":
    entry()
