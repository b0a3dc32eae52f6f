"""Reading Megatron-LM arguments from text: a line of flags, a training script, or a
`{"--flag": value}` mapping (metatrace.config.megatron.args turns the tokens into a job)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metatrace.config.megatron.flags import FLAGS
from metatrace.config.read import parse_yaml, read_text
from metatrace.errors import ConfigError


def split_args(text: str) -> list[str]:
    """The arguments in `text`: one line of flags, or a training script.

    Accepted, as a POSIX shell reads it: quotes, backslash escapes, backslash-newline
    continuations and `#` comments. The text is cut into commands at newlines and `;`, `&`,
    `|`; a redirection (`> log`, `2>&1`) ends its command. The arguments are those of the
    first command holding a word that starts with `--`, past its launcher: if a word ending in
    `.py` (the training script) is there, everything up to it is dropped (`torchrun
    --nproc_per_node 8 pretrain_gpt.py ...`), otherwise everything before the first `--` word.
    The commands right after it that start with `--` continue the arguments (a file with a
    flag per line, or comment lines amid continuations). Other commands before it (`cd`,
    `export FOO=1`, `FOO=bar`) and after it give no arguments (`environment` reads what the
    exports give the run), and arguments that use a shell variable (`$FOO`, `${FOO}`) are an
    error: metatrace does not expand them.
    """
    cmds = commands(text)
    found = arguments_command(cmds)
    assigned: dict[str, int] = {}
    args: list[_Word] = []
    if found is not None:
        index, start = found
        for words in cmds[:index] + [cmds[index][:start]]:
            for w in leading_assignments(words):
                assigned.setdefault(w.text.split("=", 1)[0], w.line)
        args = _past_launcher(cmds[index][start:])
        for words in cmds[index + 1 :]:
            if not words[0].text.startswith("--"):
                break
            args += words
    used = sorted({name for w in args for name in w.variables})
    if used:
        where = [f"${n} (set on line {assigned[n]})" if n in assigned else f"${n}" for n in used]
        raise ConfigError(
            f"the arguments use shell variables {', '.join(where)}; metatrace does not "
            "expand shell variables: write their values into the arguments"
        )
    return [w.text for w in args]


def arguments_command(cmds: list[list[_Word]]) -> tuple[int, int] | None:
    """(index of the command, index of its first word past the variable assignments) of the
    first command holding a word that starts with `--`: the one `split_args` reads."""
    for index, words in enumerate(cmds):
        k = len(leading_assignments(words))
        k += bool(words and words[0].text in _DECLARE)
        if any(w.text.startswith("--") for w in words[k:]):
            return index, k
    return None


_DECLARE = ("export", "declare", "local", "readonly")


def leading_assignments(words: list[_Word]) -> list[_Word]:
    """The `NAME=value` words a command starts with (after `export` and the like)."""
    k = 1 if words and words[0].text in _DECLARE else 0
    start = k
    while k < len(words) and ASSIGNMENT.match(words[k].text):
        k += 1
    return words[start:k]


def environment(text: str) -> tuple[dict[str, str], list[str]]:
    """(the environment a training script gives its run, the names it sets from shell
    variables): `export NAME=value` before the arguments command and the assignments in front
    of that command (`NCCL_NVLS_ENABLE=0 torchrun ...`); plain shell variables (`NAME=value`
    alone) are not in the run's environment. A later assignment wins, as in the shell."""
    cmds = commands(text)
    found = arguments_command(cmds)
    if found is None:
        return {}, []
    index, _ = found
    words = [w for c in cmds[:index] if c and c[0].text == "export" for w in leading_assignments(c)]
    words += leading_assignments(cmds[index])
    env: dict[str, str] = {}
    unexpanded: list[str] = []
    for w in words:
        name, _, value = w.text.partition("=")
        if w.variables:
            unexpanded.append(name)
            env.pop(name, None)
        else:
            env[name] = value
            if name in unexpanded:
                unexpanded.remove(name)
    return env, unexpanded


def read_args_file(path) -> list[str]:
    """The arguments in a file: a line or training script (`split_args`), or a YAML/JSON mapping
    `{"--flag": value}` (`args_from_mapping`)."""
    return read_args(path)[0]


def read_args(path) -> tuple[list[str], str | None]:
    """(the arguments in a file, its text where it is a line or a script: None for a
    mapping), as `read_args_file`."""
    path = Path(path)
    text = read_text(path, "arguments file")
    lines = [ln.strip() for ln in text.splitlines()]
    first = next((ln for ln in lines if ln and not ln.startswith("#")), "")
    mapping = first.startswith("{") or re.match(r"""^["']?--[\w.-]+["']?\s*:""", first)
    data = parse_yaml(text, str(path)) if mapping else None
    try:
        return (args_from_mapping(data), None) if mapping else (split_args(text), text)
    except ConfigError as e:
        raise ConfigError([f"{path}: {e.problems[0]}", *e.problems[1:]]) from None


def args_from_mapping(data: Any) -> list[str]:
    """Tokens of a `{"--flag": value}` mapping, as Megatron-LM's CI writes its test cases: true
    is a bare flag, false or null leaves it out, a list gives several values; a string given to
    a flag that takes several values is split at whitespace (brackets around it dropped)."""
    if not isinstance(data, dict):
        raise ConfigError(
            f"the arguments must be a mapping of flags to values, got {type(data).__name__}"
        )
    tokens = []
    for flag, value in data.items():
        if not isinstance(flag, str) or not flag.startswith("--"):
            raise ConfigError(f"{flag!r} is not a flag: the keys must be flags like '--num-layers'")
        if value is True:
            tokens.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            tokens += [flag, *(_scalar(v) for v in value)]
        elif isinstance(value, str) and getattr(FLAGS.get(flag), "nargs", 1) in ("+", "*", 3):
            tokens += [flag, *value.strip().removeprefix("[").removesuffix("]").split()]
        else:
            tokens += [flag, _scalar(value)]
    return tokens


def _scalar(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@dataclass
class _Word:
    text: str
    line: int
    variables: set


ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_NAME = re.compile(r"\{([^}]*)\}|([A-Za-z_][A-Za-z0-9_]*)|([0-9@*#?$!-])|(\()")


def _variable(text: str, i: int) -> str | None:
    """The name of the shell expansion that starts with the `$` at text[i], if any."""
    m = _NAME.match(text, i + 1)
    if m is None:
        return None
    name = m.group(1) or m.group(2) or m.group(3) or "(...)"
    return name.split("[")[0]  # ${ARGS[@]} is ARGS


def commands(text: str) -> list[list[_Word]]:
    """The words of each command of a shell text (see `split_args` for what is understood)."""
    out, words, buf = [], [], []
    state = {"in_word": False, "vars": set(), "skip": False, "line": 1, "start": 1}

    def end_word():
        if state["in_word"] and not state["skip"]:
            words.append(_Word("".join(buf), state["start"], state["vars"]))
        buf.clear()
        state.update(in_word=False, vars=set())

    def end_command():
        end_word()
        if words:
            out.append(list(words))
        words.clear()
        state["skip"] = False

    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            if text.startswith("\\\n", i):
                state["line"] += 1
            else:
                _begin(state)
                buf.append(text[i + 1 : i + 2])
            i += 2
        elif c == "'":
            j = text.find("'", i + 1)
            if j < 0:
                raise ConfigError(f"line {state['line']}: a single quote is not closed")
            _begin(state)
            buf.append(text[i + 1 : j])
            state["line"] += text.count("\n", i, j)
            i = j + 1
        elif c == '"':
            i = _double_quoted(text, i + 1, buf, state)
        elif c == "(" and ASSIGNMENT.fullmatch("".join(buf)):
            # a bash array, NAME=( ... ): one word, even over several lines
            j = text.find(")", i)
            if j < 0:
                raise ConfigError(f"line {state['line']}: a parenthesis is not closed")
            for k in range(i, j):
                if text[k] == "$" and (name := _variable(text, k)):
                    state["vars"].add(name)
            buf.append(text[i : j + 1])
            state["line"] += text.count("\n", i, j)
            i = j + 1
        elif c == "#" and not state["in_word"]:
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif c in " \t\r":
            end_word()
            i += 1
        elif c == "\n":
            end_command()
            state["line"] += 1
            i += 1
        elif c in ";|&":
            end_command()
            i += 2 if text[i : i + 2] in ("&&", "||", ";;") else 1
        elif c in "<>":
            if state["in_word"] and "".join(buf).isdigit():  # a file descriptor: 2>&1
                buf.clear()
                state["in_word"] = False
            end_word()
            state["skip"] = True  # the redirection target and the rest of the command
            i += 1
            while i < n and text[i] in "<>&":
                i += 1
        else:
            _begin(state)
            if c == "$" and (name := _variable(text, i)):
                state["vars"].add(name)
            buf.append(c)
            i += 1
    end_command()
    return out


def _begin(state: dict) -> None:
    """A word starts (or goes on) here; remember the line it started on."""
    if not state["in_word"]:
        state.update(in_word=True, start=state["line"])


def _double_quoted(text: str, i: int, buf: list, state: dict) -> int:
    start = state["line"]
    _begin(state)
    while i < len(text):
        c = text[i]
        if c == '"':
            return i + 1
        if c == "\\" and text[i + 1 : i + 2] in ("$", "`", '"', "\\", "\n"):
            if text[i + 1] == "\n":
                state["line"] += 1
            else:
                buf.append(text[i + 1])
            i += 2
            continue
        if c == "$" and (name := _variable(text, i)):
            state["vars"].add(name)
        state["line"] += c == "\n"
        buf.append(c)
        i += 1
    raise ConfigError(f"line {start}: a double quote is not closed")


def _past_launcher(words: list[_Word]) -> list[_Word]:
    for j, w in enumerate(words):
        previous = FLAGS.get(words[j - 1].text) if j else None
        value_of_flag = previous is not None and previous.nargs != 0
        if w.text.endswith(".py") and not w.text.startswith("-") and not value_of_flag:
            return words[j + 1 :]
    first = next(j for j, w in enumerate(words) if w.text.startswith("--"))
    return words[first:]
