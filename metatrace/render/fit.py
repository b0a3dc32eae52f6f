"""Tables that fit the width they are given without cutting a number, a shape or a module name,
the console that prints piped output, and items joined on lines that break between them.

A `FitTable` knows what each column holds and shrinks, when the table is too wide, only what
can shrink without losing a figure, in this order:

1. headers wrap at their spaces ("Inside nodes" on two lines);
2. prose columns (parameter shapes, collectives, messages) wrap between their items, down to
   `PROSE_MILD` columns;
3. the Type column is shortened with "…" to `TYPE_SHORT` columns;
4. module paths are shortened from the left at their dots, keeping the distinguishing tail
   ("…self_attention.linear_qkv"), down to the last name;
5. prose columns wrap down to their longest item;
6. the Type column is dropped;
7. columns move closer (two blanks apart), tree guides narrow to two columns a level, prose
   breaks between a name and its shape, and columns move to one blank apart.

Numbers, shapes, names of ranks and GPUs never shrink. Narrower than all of that together,
names, paths and prose fold onto more lines (still whole, never "…") and figures stay whole.
Rows carry no trailing spaces.

Known limitations: a cell's style applies to the whole cell (no spans within a cell).
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from typing import Literal

from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

Kind = Literal["number", "name", "module", "type", "prose"]
"""number: figures, right-aligned, never shrink; name: labels, ranks, GPUs and shapes, never
shrink; module: module paths, shortened from the left; type: class names, shortened then
dropped; prose: wraps between its items."""

PROSE_MILD = 40
TYPE_SHORT = 12
GAP = 3  # between columns: the padding on either side and the (blank) divider

# An item of prose: a shape with what names it ("w [4096, 4096]", "[0,2] [n0_g0 n1_g0]"),
# or a word with its unit ("32.0 MiB").
_ITEM = re.compile(
    r"(?:[^\s\[]*\[[^\]]*\][^\s\[]*)+(?: (?:B|KiB|MiB|GiB|TiB|ms|µs|s)(?=\s|$))?"
    r"|\S+ (?:B|KiB|MiB|GiB|TiB|ms|µs|s)(?=\s|$)"
    r"|\S+(?: \[[^\]]*\])?"
)
_ATOM = re.compile(r"\[[^\]]*\]\S*|\S+(?: (?:B|KiB|MiB|GiB|TiB|ms|µs|s)(?=\s|$))?")
_GUIDE = re.compile(r"^([│├└─ ]*)(.*)$")


def prose_items(line: str) -> list[str]:
    """The pieces a prose line may break between: never inside brackets, never between a
    number and its unit, never between a parameter's name and its shape."""
    return _ITEM.findall(line)


def prose_atoms(line: str) -> list[str]:
    """The prose items of `line` split further where it must: a name and its shape apart."""
    return [a for item in prose_items(line) for a in _ATOM.findall(item)]


def wrap(line: str, width: int) -> list[str]:
    """`line` in lines of at most `width` columns, broken between prose items (between atoms
    when an item is wider than `width`; an atom wider than that stays whole on its own line)."""
    out: list[str] = []
    items = prose_items(line)
    if any(cell_len(i) > width for i in items):
        items = prose_atoms(line)
    for item in items:
        glue = "  " if f"  {item}" in line else " "  # parameters are two spaces apart
        if out and cell_len(out[-1]) + len(glue) + cell_len(item) <= width:
            out[-1] += glue + item
        else:
            out.append(item)
    return out or [""]


def shorten_module(cell: str, width: int) -> str:
    """A module path in at most `width` columns if it can be: the tree guide kept, the path
    shortened from the left at its dots ("…self_attention.linear_qkv"), never below its last
    name."""
    guide, path = _GUIDE.match(cell).groups()  # type: ignore[union-attr]
    if cell_len(cell) <= width or "." not in path:
        return cell
    parts = path.split(".")
    tail = parts[-1]
    for part in reversed(parts[:-1]):
        longer = f"{part}.{tail}"
        if cell_len(guide) + 1 + cell_len(longer) > width:
            break
        tail = longer
    return f"{guide}…{tail}"


def _compact(cell: str) -> str:
    """A tree guide at two columns a level: "│  ├─ x" -> "│ ├ x"."""
    guide, path = _GUIDE.match(cell).groups()  # type: ignore[union-attr]
    for wide, narrow in (("│  ", "│ "), ("   ", "  "), ("├─ ", "├ "), ("└─ ", "└ ")):
        guide = guide.replace(wide, narrow)
    return guide + path


def _module_min(cell: str) -> int:
    guide, path = _GUIDE.match(cell).groups()  # type: ignore[union-attr]
    if "." not in path:
        return cell_len(cell)
    return cell_len(guide) + 1 + cell_len(path.rsplit(".", 1)[1])


def _lines(cell) -> list[str]:
    return (cell.plain if isinstance(cell, Text) else str(cell)).split("\n")


@dataclass
class _Column:
    header: str
    kind: Kind
    justify: Literal["left", "right"]
    cells: list = field(default_factory=list)

    def natural(self) -> int:
        return max([cell_len(self.header)] + [cell_len(s) for c in self.cells for s in _lines(c)])

    def header_min(self) -> int:
        return max(cell_len(w) for w in _header_words(self.header))

    def content_min(self, tight: bool = False) -> int:
        lines = [s for c in self.cells for s in _lines(c)]
        if self.kind == "prose" and tight:
            return max((cell_len(i) for s in lines for i in prose_atoms(s)), default=0)
        if self.kind == "module":
            return max((_module_min(s) for s in lines), default=0)
        if self.kind == "type":
            return 0
        if self.kind == "prose":
            return max((cell_len(i) for s in lines for i in prose_items(s)), default=0)
        return max((cell_len(s) for s in lines), default=0)


class FitTable:
    """A table (rich's SIMPLE_HEAD look) that fits its width by the policy in this module's
    docstring. Cells are plain strings or `Text` (never read as markup: "[n0_g0 n1_g0]" stays)."""

    def __init__(self, *, show_header: bool = True) -> None:
        self.show_header = show_header
        self.columns: list[_Column] = []
        self.gap, self.compact = GAP, False

    def add_column(
        self, header: str, kind: Kind = "number", justify: Literal["left", "right"] | None = None
    ) -> None:
        self.columns.append(_Column(header, kind, justify or _JUSTIFY[kind]))

    def add_row(self, *cells) -> None:
        for column, cell in zip(self.columns, cells, strict=True):
            column.cells.append("" if cell is None else cell)

    @property
    def row_count(self) -> int:
        return len(self.columns[0].cells) if self.columns else 0

    def _total(self, widths: dict[int, int], gap: int | None = None) -> int:
        return sum(widths.values()) + (gap or self.gap) * max(0, len(widths) - 1)

    def widths(self, budget: int | None) -> dict[int, int]:
        """Column index -> width for a table of at most `budget` columns (None: natural);
        a dropped column is absent. Sets `gap` (3, or 2 when tight) and `compact` (tree
        guides of two columns a level)."""
        cols = self.columns
        self.gap, self.compact = GAP, False
        widths = {i: c.natural() for i, c in enumerate(cols)}
        if budget is None or self._total(widths) <= budget:
            return widths
        head = {i: c.header_min() if self.show_header else 0 for i, c in enumerate(cols)}
        floor = {i: max(head[i], c.content_min()) for i, c in enumerate(cols)}
        tight = {i: max(head[i], c.content_min(tight=True)) for i, c in enumerate(cols)}
        cells = {i: max(floor[i], _cells_natural(c)) for i, c in enumerate(cols)}
        prose = [i for i, c in enumerate(cols) if c.kind == "prose"]
        types = [i for i, c in enumerate(cols) if c.kind == "type"]
        modules = [i for i, c in enumerate(cols) if c.kind == "module"]
        for members, target in (
            (list(widths), {i: max(head[i], cells[i]) for i in widths}),
            (prose, {i: max(floor[i], min(widths[i], PROSE_MILD)) for i in prose}),
            (types, {i: max(head[i], min(widths[i], TYPE_SHORT)) for i in types}),
            (modules, floor),
        ):
            self._shrink(widths, members, target, budget)
        self._shrink(widths, prose, floor, budget)
        if self._total(widths) > budget:
            for i in types:
                del widths[i]
        if self._total(widths) > budget:
            self.gap = 2
        if self._total(widths) > budget and modules:
            self.compact = True
            for i in modules:
                widths[i] = max(
                    [head[i]] + [_module_min(_compact(s)) for c in cols[i].cells for s in _lines(c)]
                )
        self._shrink(widths, prose, tight, budget)
        if self._total(widths) > budget:
            self.gap = 1
        # Last resort: names, paths and prose fold onto more lines; figures stay whole.
        words = [i for i, c in enumerate(cols) if c.kind != "number"]
        self._shrink(widths, words, {i: min(widths.get(i, 0), 4) for i in words}, budget)
        for i in modules + prose:  # what a narrower gap left over goes back to the cells
            spare = budget - self._total(widths)
            if spare > 0 and i in widths:
                widths[i] += max(0, min(spare, cells[i] - widths[i]))
        return widths

    def fits(self, width: int) -> bool:
        """Whether the table fits `width` columns with every cell on one line (headers may
        wrap)."""
        widths = self.widths(width)
        return len(widths) == len(self.columns) and all(
            widths[i] >= _cells_natural(c) for i, c in enumerate(self.columns)
        )

    def _shrink(self, widths, members, target, budget) -> None:
        """Narrow `members` towards `target`, the widest first, until the table fits."""
        while self._total(widths) > budget:
            over = [i for i in members if i in widths and widths[i] > target[i]]
            if not over:
                return
            widest = max(over, key=lambda i: widths[i])
            widths[widest] -= 1

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        least = self._total(self.widths(0))
        return Measurement(min(least, options.max_width), self._total(self.widths(None)))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        budget = options.max_width
        widths = self.widths(budget)
        table = Table(
            box=box.SIMPLE_HEAD,
            show_edge=False,
            pad_edge=False,
            padding=(0, 1) if self.gap == 3 else (0, self.gap - 1, 0, 0),
            show_header=self.show_header,
            collapse_padding=False,
        )
        shown = sorted(widths)
        for i in shown:
            col = self.columns[i]
            header = "\n".join(wrap_words(col.header, widths[i]))
            table.add_column(
                Text(header),
                justify=col.justify,
                width=widths[i],
                no_wrap=False,
                overflow="fold",
            )
        for r in range(self.row_count):
            table.add_row(*(self._cell(self.columns[i], r, widths[i]) for i in shown))
        width = min(self._total(widths), budget)
        for line in console.render_lines(table, options.update(width=width), pad=False):
            yield from _rstrip(line)
            yield Segment.line()

    def _cell(self, col: _Column, row: int, width: int) -> Text:
        cell = col.cells[row]
        style = cell.style if isinstance(cell, Text) else ""
        lines = _lines(cell)
        if col.kind == "module":
            lines = [shorten_module(_compact(s) if self.compact else s, width) for s in lines]
        elif col.kind == "type":
            lines = [s if cell_len(s) <= width else s[: max(0, width - 1)] + "…" for s in lines]
        elif col.kind == "prose":
            lines = [w for s in lines for w in wrap(s, width)]
        return Text("\n".join(lines), style=style)


_JUSTIFY: dict[str, Literal["left", "right"]] = {
    "number": "right",
    "name": "left",
    "module": "left",
    "type": "left",
    "prose": "left",
}


def _cells_natural(col: _Column) -> int:
    return max((cell_len(s) for c in col.cells for s in _lines(c)), default=0)


def wrap_words(text: str, width: int) -> list[str]:
    """A header in lines of at most `width` columns, broken at its spaces."""
    out: list[str] = []
    for word in _header_words(text):
        glue = "" if out and out[-1].endswith("/") else " "
        if out and cell_len(out[-1]) + len(glue) + cell_len(word) <= width:
            out[-1] += glue + word
        else:
            out.append(word)
    return out


def _header_words(text: str) -> list[str]:
    """A header's words, "Sent/GPU" as "Sent/" and "GPU"."""
    return re.findall(r"[^ /]+/?|/", text) or [""]


def _rstrip(line: list[Segment]) -> list[Segment]:
    """A rendered line without its trailing blanks."""
    line = list(line)
    while line and not line[-1].control and not line[-1].text.strip():
        line.pop()
    if line and not line[-1].control:
        last = line[-1]
        line[-1] = Segment(last.text.rstrip(), last.style, last.control)
    return line


# ----------------------------------------------------------------------------- consoles


PIPED_WIDTH = 80
"""The width of piped output without COLUMNS or --width: a terminal's, a pager's, an email's."""


class Joined:
    """Items joined by `sep` on lines of at most the console's width, broken only between
    items (an item wider than the width alone on its line, folded by rich); a line broken after
    a comma keeps it, after any other separator ends with the item."""

    def __init__(self, items, sep: str = " · ", style: str = "") -> None:
        self.items = [i if isinstance(i, Text) else Text(i) for i in items]
        self.sep, self.style = sep, style

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        end = self.sep.rstrip() if self.sep.strip() == "," else ""
        line = Text(style=self.style)
        lines = [line]
        for item in self.items:
            if line.cell_len and line.cell_len + cell_len(self.sep + item.plain) > width:
                line.append(end)
                line = Text(style=self.style)
                lines.append(line)
            elif line.cell_len:
                line.append(self.sep)
            line.append_text(item)
        yield Text("\n").join(lines)


class FirstThatFits:
    """The first of `choices`, (FitTable, what to print with it), whose table fits the width
    with every cell on one line; the last one otherwise."""

    def __init__(self, *choices) -> None:
        self.choices = choices

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for table, shown in self.choices[:-1]:
            if table.fits(options.max_width):
                yield shown
                return
        yield self.choices[-1][1]


class _NoTrailingBlanks:
    """A text stream that drops the blanks at the end of each line written to it (rich pads
    table cells and wrapped prose to the width)."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.pending = ""

    def write(self, text: str) -> int:
        text = re.sub(r"[ \t]+\n", "\n", self.pending + text)
        kept = text.rstrip(" \t")
        self.pending = text[len(kept) :]
        self.stream.write(kept)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.stream, "encoding", "utf-8")


def output_console(width: int | None = None, environ=None, stream=None) -> Console:
    """The console of a command's output: on a terminal, its width (or `width`); piped, no
    trailing blanks and `width`, else COLUMNS, else `PIPED_WIDTH`."""
    stream = sys.stdout if stream is None else stream
    environ = os.environ if environ is None else environ
    if stream.isatty():
        return Console(width=width) if width else Console()
    columns = environ.get("COLUMNS", "")
    if width is None and columns.isdigit() and int(columns) > 0:
        width = int(columns)
    return Console(file=_NoTrailingBlanks(stream), width=width or PIPED_WIDTH)
