"""Chat-template rendering: ``apply_chat_template(template, messages, ...)`` renders a jinja2
chat template as Hugging Face's ``apply_chat_template(..., tokenize=False)`` does.

Templates come from model files (GGUF metadata, tokenizer_config.json, chat_template.jinja), so
they are untrusted: they render in jinja2's immutable sandbox (no Python internals, nothing
mutable) and on a budget of steps, sizes and time, so that a hostile template is one ModelError,
never a hang or an out-of-memory. ``fusec.text.Tokenizer.apply_chat_template`` fills in the
model's template and bos/eos tokens.
"""

from __future__ import annotations

import contextvars
import json
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import InputError, ModelError


class _TemplateRaised(Exception):
    """raise_exception() called by a template: the messages do not fit it."""


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    import datetime

    return datetime.datetime.now().strftime(fmt)


# A template comes from the model file: besides the sandbox (no Python internals, nothing mutable),
# each rendering has a budget, so a hostile template is an error line instead of a hang or an
# out-of-memory. Steps: loop iterations, calls, filters, the operators * ** % + and ~. Sizes: every
# string or list a call, filter or operator makes, every printed value and the whole output stay
# under _TEMPLATE_TEXT characters (items), checked BEFORE the operations that multiply sizes
# ('x' * n, join, replace, indent, widths...) and after every other one. The wall-clock limit is a
# backstop for steps that each do much work. Real templates use a few hundred steps.
_TEMPLATE_STEPS = 1_000_000
_TEMPLATE_TEXT = 1 << 22
_TEMPLATE_SECONDS = 10.0
_INT_BITS = 4096  # integers a template computes (2 ** 10 ** 9 would take minutes)


class _TemplateBudget(Exception):
    """A template went past its budget (steps, sizes or time)."""


class _Budget:
    __slots__ = ("steps", "deadline")

    def __init__(self) -> None:
        self.steps = 0
        self.deadline = time.monotonic() + _TEMPLATE_SECONDS

    def charge(self, n: int) -> None:
        self.steps += n
        if self.steps > _TEMPLATE_STEPS:
            raise _TemplateBudget(f"more than {_TEMPLATE_STEPS} steps (loop iterations, calls, filters)")
        if time.monotonic() > self.deadline:
            raise _TemplateBudget(f"it ran longer than {_TEMPLATE_SECONDS:g} s")


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("fusec_template_budget", default=None)


def _charge(n: int = 1) -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.charge(n)


def _weight(x: Any, limit: int = _TEMPLATE_TEXT) -> int:
    """A bound on the size of ``x`` printed (characters of its strings, its items), counted only
    up to just past ``limit``: a list holding one long string a million times stops early."""
    total, stack = 0, [x]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += len(v) + 1
            stack.extend(v)
        elif isinstance(v, dict):
            total += len(v) + 1
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, int) and not isinstance(v, bool):
            total += v.bit_length() // 3 + 1
        else:
            total += 1
    return total


def _too_big(size: int, what: str) -> None:
    if size > _TEMPLATE_TEXT:
        raise _TemplateBudget(f"{what} would be larger than {_TEMPLATE_TEXT} characters")


def _sized(x: Any, what: str) -> Any:
    _too_big(_weight(x), what)
    return x


def _int_arg(x: Any, what: str) -> int:
    """An argument that is a count or a width (center(n), batch(n)...): at most _TEMPLATE_TEXT."""
    if isinstance(x, int) and not isinstance(x, bool):
        _too_big(abs(x), what)
        return abs(x)
    return 0


def _largest(values: Any) -> int:
    items = list(values.values()) if isinstance(values, Mapping) else list(values)
    return max((_weight(v) for v in items), default=0)


def _widths(fmt: str, what: str) -> None:
    """Field widths and precisions in a %-format or str.format string stay under the budget."""
    for n in re.findall(r"\d+", fmt):
        if len(n) > 7 or int(n) > _TEMPLATE_TEXT:
            raise _TemplateBudget(f"{what}: width {n[:20]} is larger than {_TEMPLATE_TEXT}")


def _precheck(name: str, value: Any, args: Sequence[Any], kwargs: Mapping[str, Any], what: str) -> None:
    """Refuse a filter or str method whose result would pass _TEMPLATE_TEXT, before it runs: the
    operations whose arguments multiply sizes. ``value``: the string (sequence) it works on."""

    def arg(i: int, key: str, default: Any = None) -> Any:
        return args[i] if len(args) > i else kwargs.get(key, default)

    if name in ("center", "batch", "slice", "ljust", "rjust", "zfill"):
        _int_arg(arg(0, "width" if name != "batch" else "linecount"), what)
    if not isinstance(value, str):
        return
    n = len(value)
    if name == "expandtabs":
        _too_big(n + value.count("\t") * _int_arg(arg(0, "tabsize", 8), what), what)
    elif name == "indent":
        width = arg(0, "width", 4)
        _too_big(n + (value.count("\n") + 1) * (_int_arg(width, what) or _weight(width)), what)
    elif name == "replace":
        old, new, count = arg(0, "old"), arg(1, "new"), arg(2, "count")
        if isinstance(old, str) and isinstance(new, str):
            hits = value.count(old) if old else n + 1
            if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
                hits = min(hits, count)
            _too_big(n + hits * (len(new) - len(old)), what)
    elif name in ("format", "format_map"):  # str.format, the format filter, % (each field once or more)
        _widths(value, what)
        biggest = max([_largest(args), _largest(kwargs)] + [_largest(a) for a in args if isinstance(a, Mapping)])
        _too_big(n + (value.count("{") + value.count("%")) * biggest, what)
    elif name == "translate":
        table = arg(0, "table")
        _too_big(n * max(1, _largest(table) if isinstance(table, Mapping) else 1), what)
    elif name == "wordwrap":
        width = max(_int_arg(arg(0, "width", 79), what), 1)
        _too_big(n + (n // width + value.count("\n") + 1) * _weight(arg(2, "wrapstring", "\n")), what)
    elif name == "urlize":
        _too_big(n + n * sum(_weight(a) for a in (*args, *kwargs.values()) if isinstance(a, str)), what)


def _join_size(sep: Any, items: Sequence[Any], what: str) -> None:
    total = _weight(sep) * max(len(items) - 1, 0)
    for i in items:
        if total > _TEMPLATE_TEXT:
            break
        total += _weight(i)
    _too_big(total, what)


def _guard_filter(name: str, f: Any) -> Any:
    """``f`` with the budget: a step, the sizes it multiplies (checked first), its result's size."""
    import functools

    from jinja2.utils import _PassArg

    skip = 0 if _PassArg.from_obj(f) is None else 1  # a context / eval context / environment comes first
    what = f"filter {name!r}"

    @functools.wraps(f)  # keeps jinja's pass_context & co. marks
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _charge()
        real = list(args[skip:])
        if name == "join" and real:
            if not isinstance(real[0], (str, list, tuple)):
                real[0] = list(real[0])  # a generator (map, select): counted here, then measured
                _charge(len(real[0]))
                args = (*args[:skip], *real)
            _join_size(real[1] if len(real) > 1 else kwargs.get("d", ""), list(real[0]), what)
        elif name == "sum" and real:
            start = real[2] if len(real) > 2 else kwargs.get("start", 0)
            if not isinstance(start, (int, float)):
                raise _TemplateBudget(f"{what} of strings or lists (start={type(start).__name__}) takes quadratic time")
        elif name == "tojson" and real:
            indent = real[2] if len(real) > 2 else kwargs.get("indent")
            if indent is not None and (_int_arg(indent, what) or _weight(indent)) > 64:
                raise _TemplateBudget(f"{what}: indent {indent!r:.20} is too wide")
        elif real:
            _precheck(name, real[0], real[1:], kwargs, what)
        return _sized(f(*args, **kwargs), f"the result of {what}")

    return guarded


def _loop(seq: Any) -> Any:
    """A for loop's sequence: its length is charged up front (the loop then sees the sequence
    itself: ``loop.length``, ``loop.last`` unchanged); an iterator without a length item by item."""
    try:
        n = len(seq)
    except TypeError:
        return _counted(seq)
    _charge(n)
    return seq


def _counted(seq: Any) -> Any:
    for item in seq:
        _charge()
        yield item


def _concat(*parts: Any) -> str:
    """``a ~ b ~ c``, as jinja's str_join (autoescape is off), sized first."""
    total = 0
    for p in parts:
        total += _weight(p)
        _too_big(total, "a ~ concatenation")
    return "".join(str(p) for p in parts)


def _environment() -> Any:
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.visitor import NodeTransformer

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks in
        HF templates): renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    class Budgeted(ImmutableSandboxedEnvironment):
        """The immutable sandbox, each call and intercepted operator charged and sized."""

        intercepted_binops = frozenset({"*", "**", "%", "+"})

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            _charge()
            target = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
            owner, name = getattr(target, "__self__", None), getattr(target, "__name__", "")
            what = f"calling {name or type(__obj).__name__}"
            if isinstance(owner, str):
                if name == "join" and args:
                    items = args[0] if isinstance(args[0], (list, tuple)) else list(args[0])
                    _charge(len(items))
                    _join_size(owner, items, what)
                    args = (items, *args[1:])
                else:
                    _precheck(name, owner, args, kwargs, what)
            return _sized(super().call(__context, __obj, *args, **kwargs), f"the result of {what}")

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _charge()
            ints = [isinstance(v, int) and not isinstance(v, bool) for v in (left, right)]
            if operator == "*":
                if all(ints):
                    if left.bit_length() + right.bit_length() > _INT_BITS:
                        raise _TemplateBudget(f"an integer product larger than {_INT_BITS} bits")
                elif ints[0] or ints[1]:
                    seq, n = (right, left) if ints[0] else (left, right)
                    _too_big(_weight(seq) * max(n, 0), "repeating a string or list")
            elif operator == "**" and all(ints) and right > 0 and abs(left) > 1:
                if right * left.bit_length() > _INT_BITS:
                    raise _TemplateBudget(f"a power larger than {_INT_BITS} bits")
            elif operator == "%" and isinstance(left, str):
                values = right if isinstance(right, tuple) else (right,)
                if "*" in left:  # widths taken from the arguments
                    for v in values:
                        _int_arg(v, "%-formatting")
                _precheck("format", left, values, {}, "%-formatting")
            return _sized(super().call_binop(context, operator, left, right), f"the result of {operator!r}")

    class Instrument(NodeTransformer):
        """Every for loop's sequence goes through _loop (charged), every ~ through _concat (sized)."""

        def visit_For(self, node: Any) -> Any:
            node = self.generic_visit(node)
            node.iter = nodes.Call(nodes.Name("_fusec_loop", "load", lineno=node.lineno), [node.iter], [], None, None,
                                   lineno=node.lineno)
            return node

        def visit_Concat(self, node: Any) -> Any:
            node = self.generic_visit(node)
            return nodes.Call(nodes.Name("_fusec_concat", "load", lineno=node.lineno), node.nodes, [], None, None,
                              lineno=node.lineno)

    env = Budgeted(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, Generation],
                   finalize=lambda v: _sized(v, "a printed value"))
    env.filters["tojson"] = _tojson
    env.filters = {name: _guard_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["_fusec_loop"] = _loop
    env.globals["_fusec_concat"] = _concat
    return env, Instrument()


_ENV: Any = None  # (environment, AST instrumenter), made on first use


def apply_chat_template(template: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                        **extra: Any) -> str:
    """Render a chat ``template`` (jinja2, from a model file: run sandboxed, on a budget of steps,
    sizes and time) over ``messages`` (``[{"role": ..., "content": ...}, ...]``), as Hugging
    Face's ``apply_chat_template(..., tokenize=False)`` does. ``extra`` (bos_token, eos_token,
    tools, ...) goes to the template. ModelError for a broken template or one past its budget,
    InputError when the template rejects the messages."""
    import jinja2

    global _ENV
    if not isinstance(template, str):
        raise ModelError(f"chat template must be a string, got {type(template).__name__}")
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not all(
            isinstance(m, Mapping) for m in messages):
        raise InputError("chat messages must be a list of {'role': ..., 'content': ...} mappings")
    if _ENV is None:
        _ENV = _environment()
    env, instrument = _ENV
    context = {"bos_token": "", "eos_token": "", **extra}
    token = _BUDGET.set(_Budget())
    try:  # compiling is on the budget too: jinja folds constant expressions (filters) as it compiles
        try:
            compiled = env.from_string(instrument.visit(env.parse(template)))
        except jinja2.TemplateSyntaxError as e:
            raise ModelError(f"chat template has a syntax error (line {e.lineno}): {e.message}") from None
        out, size = [], 0
        for chunk in compiled.generate(messages=[dict(m) for m in messages],
                                       add_generation_prompt=add_generation_prompt, **context):
            size += len(chunk)
            _too_big(size, "its output")
            out.append(chunk)
        return "".join(out)
    except _TemplateRaised as e:
        raise InputError(f"chat template rejected the messages: {e}") from None
    except _TemplateBudget as e:
        raise ModelError(f"chat template exceeds its budget: {e}") from None
    except jinja2.exceptions.SecurityError as e:
        raise ModelError(f"chat template tried an unsafe operation: {e}") from None
    except RecursionError:
        raise ModelError("chat template exceeds its budget: recursion too deep") from None
    except MemoryError:
        raise ModelError("chat template exceeds its budget: out of memory") from None
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputError(f"chat template failed on these messages: {first}") from None
    finally:
        _BUDGET.reset(token)
