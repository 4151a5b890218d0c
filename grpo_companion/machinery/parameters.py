"""A chapter's parameters and the ranges they accept, read from its `parameters` cell.

Each line of the cell is `name = literal` or, with the accepted range beside the default,
`name: "constraint" = literal`, as CleanRL's `Args` keeps a setting's type beside its value:

    num_repeats: ">= 1" = 200
    logit_scale: "> 0" = 1.5
    clip_epsilons: "> 0 and < 1" = [0.1, 0.2]    # a list: every entry, and at least one
    grpo: "GRPOConfig" = {"learning_rate": 3e-5}  # a dict: the config it builds must accept it

A constraint is clauses joined by `and`, each an operator (`>=`, `>`, `<=`, `<`, `in`) and a
Python literal, or the name of a config class in `CONFIGS`. The command line checks every value
against it before any cell runs (`pipeline.resolve_parameters`).
"""

import ast
import operator

OPERATORS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}


def _config(name: str):
    """The config class a dict parameter is built into (imported late: only when checked)."""
    if name == "GRPOConfig":
        from grpo_companion.lm.config import GRPOConfig

        return GRPOConfig
    if name == "TinyLlamaSpec":
        from grpo_companion.lm.tiny_llama import TinyLlamaSpec

        return TinyLlamaSpec
    return None


CONFIGS = ("GRPOConfig", "TinyLlamaSpec")


class ParameterError(ValueError):
    """A parameter's value outside its range, or a constraint that cannot be read."""


def read_cell(source: str, where: str) -> tuple[dict, dict]:
    """(defaults, constraints) of a parameters cell's source; `where` names it in errors."""
    defaults, constraints = {}, {}
    for statement in ast.parse(source).body:
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target = statement.targets[0]
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            target = statement.target
        else:
            target = None
        if not isinstance(target, ast.Name):
            raise ParameterError(
                f"{where}: the parameters cell may hold only `name = literal` or "
                f'`name: "constraint" = literal` lines'
            )
        defaults[target.id] = ast.literal_eval(statement.value)
        if isinstance(statement, ast.AnnAssign):
            constraint = ast.literal_eval(statement.annotation)
            if not isinstance(constraint, str):
                raise ParameterError(f"{where}: the constraint of {target.id!r} must be a string")
            _clauses(constraint, f"{where}: parameter {target.id!r}")  # readable, or refused now
            constraints[target.id] = constraint
    return defaults, constraints


def _clauses(constraint: str, where: str) -> list[tuple[str, object]]:
    if constraint in CONFIGS:
        return [("config", constraint)]
    clauses = []
    for clause in constraint.split(" and "):
        op, _, literal = clause.strip().partition(" ")
        if op not in (*OPERATORS, "in"):
            raise ParameterError(f"{where}: cannot read the constraint {constraint!r}")
        try:
            clauses.append((op, ast.literal_eval(literal.strip())))
        except (ValueError, SyntaxError) as error:
            raise ParameterError(f"{where}: cannot read the constraint {constraint!r}") from error
    return clauses


def violation(name: str, value, constraint: str) -> str | None:
    """Why `value` breaks `constraint` (one line naming the parameter), or None when it holds."""
    for op, bound in _clauses(constraint, f"parameter {name!r}"):
        if op == "config":
            try:
                _config(bound)(**value)
            except (TypeError, ValueError) as error:
                return f"parameter {name!r} is refused by {bound}: {error}"
            continue
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        if isinstance(value, (list, tuple)) and not items:
            return f"parameter {name!r} needs at least one entry, got {value!r}"
        for item in items:
            try:
                holds = item in bound if op == "in" else OPERATORS[op](item, bound)
            except TypeError:
                holds = False
            if not holds:
                shown = constraint if len(items) == 1 else f"{constraint} in every entry"
                return f"parameter {name!r} must be {shown}, got {value!r}"
    return None
