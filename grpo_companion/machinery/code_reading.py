"""Reading the names a piece of code records, without running it: the machinery of
`declarations.declare`.

`Scope` holds one module's or function's assignments (which value reaches a line), imports
and parents; `Reader` follows a name, an f-string or a dict expression to the strings it can
hold: loop variables over literals, a nested function's arguments, a module's constant tuples,
and the dict a library function returns (read from its source, with the call's literal string
arguments bound). What it cannot name becomes the glob `*`, or a `DeclarationError` that names
the line.
"""

import ast
import importlib
import inspect
import itertools
import textwrap

GLOB = "*"


class DeclarationError(ValueError):
    """A recorded name the chapter's code does not spell out."""


class Scope:
    """Assignments of one module or function body, and the names it imports."""

    def __init__(self, tree: ast.AST, module=None, bound: dict | None = None):
        self.module, self.bound = module, bound or {}
        self.assigned: dict[str, list] = {}
        self.parents: dict[ast.AST, ast.AST] = {}
        self.imports: dict[str, str] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = alias.name
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    self._assign(target, node.value, node.lineno, "set")
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                self._assign(node.target, node.value, node.lineno, "set")
            elif isinstance(node, ast.AugAssign):
                self._assign(node.target, node.value, node.lineno, "update")
            elif (
                isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "update" and isinstance(node.func.value, ast.Name)
                and len(node.args) == 1
            ):  # fmt: skip
                self._assign(node.func.value, node.args[0], node.lineno, "update")

    def _assign(self, target, value, line, kind, index=None):
        if isinstance(target, ast.Name):
            self.assigned.setdefault(target.id, []).append((line, kind, value, index))
        elif isinstance(target, ast.Tuple):
            for i, element in enumerate(target.elts):
                self._assign(element, value, line, kind, i if index is None else None)
        elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
            key = ast.Dict(keys=[target.slice], values=[ast.Constant(None)])
            self.assigned.setdefault(target.value.id, []).append((line, "update", key, None))

    def reaching(self, name: str, line: int) -> list:
        """(value, index) of the assignments of `name` that reach `line`: the last one that
        sets it before `line` (or every one, if none is before it: a function's loop) and the
        updates after it (`|=`, `x[key] = `)."""
        entries = sorted(self.assigned.get(name, []), key=lambda entry: entry[0])
        before = [entry for entry in entries if entry[0] < line] or entries
        sets = [i for i, entry in enumerate(before) if entry[1] == "set"]
        start = sets[-1] if sets else 0
        chosen = before[start:] + [e for e in entries if e[0] >= line and e[1] == "update"
                                   and not [x for x in entries if x[0] < line]]  # fmt: skip
        return [(value, index) for _, _, value, index in chosen]

    def resolve(self, dotted: str):
        """The object a dotted name of this scope refers to, or None."""
        head, _, rest = dotted.partition(".")
        if head in self.imports:
            target = self.imports[head] + (f".{rest}" if rest else "")
        elif self.module is not None and hasattr(self.module, head):
            target = f"{self.module.__name__}.{dotted}"
        else:
            return None
        parts = target.split(".")
        for split in range(len(parts), 0, -1):
            try:
                found = importlib.import_module(".".join(parts[:split]))
            except ImportError:
                continue
            for attribute in parts[split:]:
                found = getattr(found, attribute, None)
            return found
        return None


def dotted(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


class Reader:
    """Reads the keys an expression can hold, following names, calls and loops."""

    def __init__(self, depth: int = 0):
        self.depth = depth

    def fail(self, node, scope, what: str):
        where = f"{scope.module.__name__}: " if scope.module else ""
        raise DeclarationError(
            f"{where}line {getattr(node, 'lineno', '?')}: cannot tell which {what} "
            f"`{ast.unparse(node)[:80]}` records; write the name as a literal, an f-string, or "
            "the literal keys of a returned dict"
        )

    # -- strings: a literal, an f-string, or a loop variable -----------------------------
    def strings(self, node, scope) -> set[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, ast.Name) and node.id in scope.bound:
            return set(scope.bound[node.id])
        if isinstance(node, ast.JoinedStr):
            parts = []
            for value in node.values:
                if isinstance(value, ast.Constant):
                    parts.append({str(value.value)})
                else:
                    inner = value.value
                    if isinstance(inner, ast.Name):
                        parts.append(self.strings(inner, scope))
                    else:
                        known = self.loop_values(inner, value, scope)
                        parts.append(known if known is not None else {GLOB})
            return {"".join(choice) for choice in itertools.product(*parts)}
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = self.strings(node.left, scope), self.strings(node.right, scope)
            return {a + b for a in left for b in right}
        if isinstance(node, ast.Name):
            values = self.loop_values(node, node, scope)
            if values is not None:
                return values
            assigned = scope.reaching(node.id, node.lineno) if node.id in scope.assigned else []
            if assigned and all(isinstance(value, (ast.Constant, ast.JoinedStr, ast.BinOp))
                                and index is None for value, index in assigned):  # fmt: skip
                return set().union(*(self.strings(value, scope) for value, _ in assigned))
        return {GLOB}

    def loop_values(self, name_node, at, scope) -> set[str] | None:
        """The values a name (or a constant argument) takes where `at` stands: from the literal
        argument of a call, or from an enclosing for loop over a literal or a dict's keys."""
        if isinstance(name_node, ast.Constant):
            return {str(name_node.value)}
        if not isinstance(name_node, ast.Name):
            return None
        if name_node.id in scope.bound:
            return set(scope.bound[name_node.id])
        node = at
        while node in scope.parents:
            node = scope.parents[node]
            if isinstance(node, ast.FunctionDef) and node in scope.parents:
                found = self._argument_values(node, name_node.id, scope)
                if found is not None:
                    return found
            targets = []
            if isinstance(node, ast.For):
                targets = [(node.target, node.iter)]
            elif isinstance(node, (ast.DictComp, ast.ListComp, ast.SetComp, ast.GeneratorExp)):
                targets = [(g.target, g.iter) for g in node.generators]
            for target, iterable in targets:
                found = self._bind(target, iterable, name_node.id, scope)
                if found is not None:
                    return found
        return None

    def _argument_values(self, function: ast.FunctionDef, name: str, scope):
        """The strings a nested function's parameter `name` receives at its calls in `scope`."""
        parameters = [a.arg for a in function.args.args]
        if name not in parameters:
            return None
        values, root = set(), function
        while root in scope.parents:
            root = scope.parents[root]
        for call in ast.walk(root):
            if isinstance(call, ast.Call) and dotted(call.func) == function.name:
                arguments = dict(zip(parameters, call.args))
                arguments |= {k.arg: k.value for k in call.keywords if k.arg}
                if name in arguments:
                    values |= self.strings(arguments[name], scope)
        return values or {GLOB}

    def _bind(self, target, iterable, name, scope):
        """The values `name` takes in `for target in iterable`, or None if it is not bound."""
        if isinstance(target, ast.Name):
            if target.id != name:
                return None
            return self.elements(iterable, scope) or {GLOB}
        if isinstance(target, ast.Tuple):
            positions = [i for i, e in enumerate(target.elts) if isinstance(e, ast.Name)
                         and e.id == name]  # fmt: skip
            nested = [e for e in target.elts if isinstance(e, ast.Tuple)]
            if not positions:
                for element in nested:
                    if any(isinstance(e, ast.Name) and e.id == name for e in element.elts):
                        return {GLOB}
                return None
            position = positions[0]
            call = iterable
            if isinstance(call, ast.Call) and dotted(call.func) == "zip":
                if position < len(call.args):
                    return self.elements(call.args[position], scope) or {GLOB}
                return {GLOB}
            if (
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute)
                and (call.func.attr == "items" and position == 0)
            ):
                return self.keys(call.func.value, scope, allow_glob=True)
            if isinstance(iterable, (ast.List, ast.Tuple)):
                values = set()
                for element in iterable.elts:
                    if isinstance(element, ast.Tuple) and position < len(element.elts):
                        values |= self.strings(element.elts[position], scope)
                    else:
                        values.add(GLOB)
                return values
            return {GLOB}
        return None

    def elements(self, node, scope) -> set[str] | None:
        """The strings a literal sequence holds (a dict: its keys), or None."""
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            values = set()
            for element in node.elts:
                values |= self.strings(element, scope)
            return values
        if isinstance(node, ast.Dict) or (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "keys"
        ):  # fmt: skip
            return self.keys(node.func.value if isinstance(node, ast.Call) else node, scope,
                             allow_glob=True)  # fmt: skip
        if isinstance(node, ast.Name) and node.id not in scope.assigned:
            constant = scope.resolve(node.id)  # a module's constant, or an imported one
            if isinstance(constant, (tuple, list, dict, set)) and all(
                isinstance(value, str) for value in constant
            ):
                return set(constant)
            return None
        if isinstance(node, ast.Name) and node.id in scope.assigned:
            values = set()
            for value, index in scope.reaching(node.id, node.lineno):
                if index is not None:
                    return None
                found = self.elements(value, scope)
                if found is None:
                    return None
                values |= found
            return values
        return None

    # -- keys: of a dict expression --------------------------------------------------------
    def keys(self, node, scope, allow_glob: bool = False, index=None) -> set[str]:
        if isinstance(node, ast.Dict):
            found = set()
            for key, value in zip(node.keys, node.values):
                found |= self.keys(value, scope, allow_glob) if key is None else (
                    self.strings(key, scope))  # fmt: skip
            return found
        if isinstance(node, ast.DictComp):
            return self.strings(node.key, scope)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return self.keys(node.left, scope, allow_glob) | self.keys(node.right, scope,
                                                                       allow_glob)  # fmt: skip
        if isinstance(node, ast.IfExp):
            return self.keys(node.body, scope, allow_glob) | self.keys(node.orelse, scope,
                                                                       allow_glob)  # fmt: skip
        if isinstance(node, ast.Tuple) and index is not None and index < len(node.elts):
            return self.keys(node.elts[index], scope, allow_glob)
        if isinstance(node, ast.Name) and node.id in scope.assigned:
            found = set()
            for value, position in scope.reaching(node.id, node.lineno):
                if isinstance(value, ast.Constant) and value.value is None:
                    continue
                found |= self.keys(value, scope, allow_glob, position)
            return found
        if isinstance(node, ast.Call):
            name = dotted(node.func)
            if name == "dict" and not node.args:
                return {keyword.arg for keyword in node.keywords if keyword.arg}
            if isinstance(node.func, ast.Attribute) and node.func.attr in ("items", "copy"):
                return self.keys(node.func.value, scope, allow_glob)
            function = scope.resolve(name) if name else None
            if callable(function) and getattr(function, "__module__", "").startswith(
                "grpo_companion"
            ):
                return self.returned_keys(function, node, scope, index)
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            return self.subscript_keys(node, scope, allow_glob)
        if allow_glob:
            return {GLOB}
        self.fail(node, scope, "keys")

    def subscript_keys(self, node, scope, allow_glob):
        """`x["records"]` of a dict a function returns: x assigned from the call, or a loop's
        value over the dict a comprehension of such calls builds."""
        for call, position in self._calls_behind(node.value, scope):
            name = dotted(call.func)
            function = scope.resolve(name) if name else None
            if not callable(function):
                continue
            inner_scope, returns = self.function_scope(function, call, scope)
            for returned in returns:
                picked = returned
                if isinstance(returned, ast.Tuple) and position is not None:
                    picked = returned.elts[position]
                if isinstance(picked, ast.Dict):
                    for key, item in zip(picked.keys, picked.values):
                        if isinstance(key, ast.Constant) and key.value == node.slice.value:
                            return self.keys(item, inner_scope, allow_glob)
        if allow_glob:
            return {GLOB}
        self.fail(node, scope, "keys")

    def _calls_behind(self, node, scope) -> list:
        """(call, tuple position) of the calls whose result the name `node` holds."""
        if not isinstance(node, ast.Name):
            return []
        found = [(value, position) for value, position in scope.reaching(node.id, node.lineno)
                 if isinstance(value, ast.Call)] if node.id in scope.assigned else []  # fmt: skip
        loop = node
        while loop in scope.parents:
            loop = scope.parents[loop]
            if not isinstance(loop, ast.For) or not isinstance(loop.target, ast.Tuple):
                continue
            names = [getattr(e, "id", None) for e in loop.target.elts]
            iterable = loop.iter
            if (
                node.id in names[1:2]
                and isinstance(iterable, ast.Call)
                and isinstance(iterable.func, ast.Attribute)
                and iterable.func.attr == "items"
                and isinstance(iterable.func.value, ast.Name)
            ):
                source = iterable.func.value
                for value, _ in scope.reaching(source.id, source.lineno):
                    if isinstance(value, ast.DictComp) and isinstance(value.value, ast.Call):
                        found.append((value.value, None))
        return found

    def function_scope(self, function, call, caller):
        source = textwrap.dedent(inspect.getsource(function))
        tree = ast.parse(source).body[0]
        bound = {}
        parameters = [a.arg for a in tree.args.posonlyargs + tree.args.args]
        for name, argument in zip(parameters, call.args):
            if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
                bound[name] = {argument.value}
        for keyword in call.keywords:
            if isinstance(keyword.value, ast.Constant) and isinstance(keyword.value.value, str):
                bound[keyword.arg] = {keyword.value.value}
        defaults = tree.args.defaults
        for name, default in zip(parameters[len(parameters) - len(defaults) :], defaults):
            if (
                name not in bound
                and isinstance(default, ast.Constant)
                and isinstance(default.value, str)
            ):
                bound[name] = {default.value}
        for arg, default in zip(tree.args.kwonlyargs, tree.args.kw_defaults):
            if (
                arg.arg not in bound
                and isinstance(default, ast.Constant)
                and isinstance(default.value, str)
            ):
                bound[arg.arg] = {default.value}
        scope = Scope(tree, inspect.getmodule(function), bound)
        return scope, _returns(tree)

    def returned_keys(self, function, call, caller, index) -> set[str]:
        if self.depth > 6:
            return {GLOB}
        scope, returns = self.function_scope(function, call, caller)
        reader = Reader(self.depth + 1)
        found = set()
        for returned in returns:
            if isinstance(returned, ast.Tuple) and index is None:
                continue
            found |= reader.keys(returned, scope, index=index)
        if not found:
            self.fail(call, caller, "keys")
        return found


def _returns(function: ast.AST) -> list:
    """The values `function` returns, not those of the functions defined inside it."""
    found, stack = [], list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Return) and node.value is not None:
            found.append(node.value)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))
    return found


def unconditional(node, scope) -> bool:
    """Whether `node` runs on every run of its cell: under no if, try or while, and in for
    loops only over literal sequences."""
    while node in scope.parents:
        node = scope.parents[node]
        if isinstance(node, (ast.If, ast.Try, ast.While, ast.IfExp, ast.FunctionDef)):
            return False
        if isinstance(node, ast.For) and not isinstance(node.iter, (ast.List, ast.Tuple)):
            return False
    return True
