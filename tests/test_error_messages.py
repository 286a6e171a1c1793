"""Every error message in csrc/ formats its numbers itself (int_str, float_str,
sym_str, shape_str or std::to_string; csrc/kda.h). TORCH_CHECK and c10::str insert
their arguments into a std::ostream, and inserting an int or a double there from
inside the extension crashes the process in libstdc++'s locale code on the GPU
machine's image (torch 2.11, GCC 13), so a message that streams a number turns a
clear error into a segfault. The scan reads the sources, so it runs anywhere."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent / "csrc"
MACROS = re.compile(r"\b(TORCH_CHECK|TORCH_CHECK_VALUE|TORCH_CHECK_INDEX|TORCH_CHECK_NOT_IMPLEMENTED|"
                    r"TORCH_INTERNAL_ASSERT|c10::str)\s*\(")
# Calls that return text (a name: dtype_name, recurrence_block_name, ...).
FORMATTERS = re.compile(r"(std::to_string|int_str|float_str|sym_str|shape_str|std::string|message|\w+_name)\(")
# Parameters and locals that the messages take as text (const char*, std::string
# or c10::string_view), checked by reading each use below.
TEXT_NAMES = {"op", "name", "layout", "what", "why", "arg", "names", "forced_name"}
STRING_LITERALS = re.compile(r'\s*("(?:[^"\\]|\\.)*"\s*)+')


def macro_arguments(text, start):
    """The top-level comma-separated arguments of the call whose '(' ends at start."""
    args, current, depth, i = [], "", 0, start
    while i < len(text):
        c = text[i]
        if c == '"':
            j = i + 1
            while text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            current += text[i:j + 1]
            i = j + 1
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                return args + [current.strip()]
            depth -= 1
        elif c == "," and depth == 0:
            args.append(current.strip())
            current = ""
            i += 1
            continue
        current += c
        i += 1
    raise AssertionError("unbalanced call")


def is_text(arg):
    arg = " ".join(arg.split())
    if STRING_LITERALS.fullmatch(arg) or FORMATTERS.match(arg) or arg in TEXT_NAMES or arg.endswith(".str()"):
        return True
    ternary = re.fullmatch(r"[^?]+\?(.+):(.+)", arg)  # cond ? "a" : "b"
    return bool(ternary) and all(STRING_LITERALS.fullmatch(side) for side in ternary.groups())


def message_arguments():
    for path in sorted(ROOT.rglob("*")):
        if path.suffix not in (".cpp", ".cu", ".h", ".cuh"):
            continue
        text = path.read_text()
        for m in MACROS.finditer(text):
            args = macro_arguments(text, m.end())
            line = text.count("\n", 0, m.start()) + 1
            # TORCH_CHECK's first argument is the condition; c10::str has none.
            for arg in args if m.group(1) == "c10::str" else args[1:]:
                yield f"{path.relative_to(ROOT.parent)}:{line}", arg


def test_messages_format_their_numbers():
    found = list(message_arguments())
    assert len(found) > 100  # the scan sees the messages
    streamed = [f"{where}: {' '.join(arg.split())}" for where, arg in found if not is_text(arg)]
    assert not streamed, "format these with int_str / std::to_string (csrc/kda.h):\n" + "\n".join(streamed)


def test_the_scan_catches_a_streamed_number():
    text = 'TORCH_CHECK(x > 0, op, ": got ", x, " (", int_str(x), ")", cond ? "a" : "b");'
    args = macro_arguments(text, text.index("(") + 1)
    assert [is_text(a) for a in args[1:]] == [True, True, False, True, True, True, True]
