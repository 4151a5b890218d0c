"""The checks of the claims ledger: `low <= expression <= high`, the expression over one chapter's
recorded values, parsed and never `eval`ed: numbers, result keys, subscripts
(`ranks["tiny-llama"]["8"]`), + - * / **, the functions of `FUNCTIONS`, and `known(x)`: 1 when
x is a finite number, 0 when it is missing (an absent subscript), None or NaN, so that a rule can
say "the run measured nothing" (a model with no mixed group has no effective rank to record),
and `reading(low, high, predicted)`: how an interval reads against the predicted effect (+1
supports, -1 contradicts, 0 neither; `core.stats.interval_reading`, the function the chapters'
sentences use). A value that was not measured is NaN elsewhere, and NaN passes no check, nor
its negation (`outside`): missing evidence is never a contradiction."""

import ast
import math
import operator
from dataclasses import dataclass

from grpo_companion.core.stats import interval_reading


def _nan_aware(reduce):
    """min or max of numbers, NaN if any is NaN (Python's min(1, nan) is 1, min(nan, 1) nan)."""

    def function(*args):
        items = args[0] if len(args) == 1 else args
        items = list(items.values() if isinstance(items, dict) else items)
        return math.nan if any(math.isnan(item) for item in items) else reduce(items)

    return function


def _reading(low, high, predicted) -> float:
    return float(interval_reading(*(None if math.isnan(v) else v for v in (low, high, predicted))))


FUNCTIONS = {
    "abs": abs,
    "min": _nan_aware(min),
    "max": _nan_aware(max),
    "len": len,
    "sum": sum,
    "reading": _reading,
}
OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: lambda a, b: a / b if b else math.nan,  # undefined: passes no check
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def expression_keys(expression: str) -> list[str]:
    """The result keys `expression` reads, in order of first use."""
    tree = ast.parse(expression, mode="eval")
    functions = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    names = sorted(
        (node.col_offset, node.id)
        for node in ast.walk(tree)
        if isinstance(node, ast.Name) and id(node) not in functions
    )
    return list(dict.fromkeys(name for _, name in names))


def evaluate_expression(expression: str, values: dict):
    """`expression` with each key replaced by `values[key]`; only the grammar above."""

    def walk(node):
        if _is_call(node, "known") and len(node.args) == 1:
            try:
                value = walk(node.args[0])
            except (LookupError, TypeError):
                return 0.0
            return float(isinstance(value, int | float) and math.isfinite(value))
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float | str):
            return node.value
        if isinstance(node, ast.Name):
            return math.nan if values[node.id] is None else values[node.id]
        if isinstance(node, ast.BinOp | ast.UnaryOp) and type(node.op) in OPERATORS:
            operands = (node.left, node.right) if isinstance(node, ast.BinOp) else (node.operand,)
            return OPERATORS[type(node.op)](*map(walk, operands))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in FUNCTIONS
            and not node.keywords
        ):
            return FUNCTIONS[node.func.id](*map(walk, node.args))
        if isinstance(node, ast.Subscript):
            value = walk(node.value)[walk(node.slice)]
            return math.nan if value is None else value
        raise ValueError(f"unsupported in a check: {ast.unparse(node)!r} in {expression!r}")

    return walk(ast.parse(expression, mode="eval").body)


def _is_call(node, name: str) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == name
        and not node.keywords
    )


def finite(value: float) -> float | None:
    """None for NaN (a ratio of zeros) and infinity (no bound), which JSON lacks."""
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class Check:
    """`low <= expression <= high`, the expression over one chapter's recorded values; with
    `outside`, the value was measured and lies outside those bounds (a contradiction)."""

    expression: str
    low: float = -math.inf
    high: float = math.inf
    outside: bool = False

    def __str__(self) -> str:
        if self.outside:
            if self.low == -math.inf:
                return f"{self.expression} > {self.high:g}"
            if self.high == math.inf:
                return f"{self.expression} < {self.low:g}"
            return f"{self.expression} outside [{self.low:g}, {self.high:g}]"
        if self.low == -math.inf:
            return f"{self.expression} ≤ {self.high:g}"
        if self.high == math.inf:
            return f"{self.expression} ≥ {self.low:g}"
        return f"{self.low:g} ≤ {self.expression} ≤ {self.high:g}"

    def judge(self, values: dict) -> dict:
        try:
            value = float(evaluate_expression(self.expression, values))
        except (LookupError, TypeError):  # a subscript the run did not record: not measured
            value = math.nan
        return {
            "expression": self.expression,
            "rule": str(self),
            "value": finite(value),
            "low": finite(self.low),
            "high": finite(self.high),
            "passed": (not math.isnan(value)) and (self.low <= value <= self.high) != self.outside,
        }


def near(expression: str, target: float, tolerance: float, outside: bool = False) -> Check:
    """`expression` within `tolerance` of `target` (a source's number, or a theoretical value);
    with `outside`, measured and farther than `tolerance` from it."""
    sign = "+" if target < 0 else "-"
    return Check(f"abs({expression} {sign} {abs(target)!r})", high=tolerance, outside=outside)
