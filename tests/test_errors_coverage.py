"""docs/errors.md covers every error mini_ddp raises: a walk over the package's raise sites.

Every ``.py`` under ``src/mini_ddp`` is parsed with :mod:`ast` (not imported), so the check does
not care which module a raise sits in. A *message site* is

* ``raise SomeError(...)`` (or ``err = SomeError(...)``, then ``raise err``): its message is the
  string literals among the call's arguments. f-strings give their constant parts; a name is
  resolved to a string assigned to it in the same function or at module level, or imported
  from another module of the package; a function's parameter to each string that calls of it
  in the same module pass it (a helper handed torch's sentence). A raise of what a function
  returns (``raise step.unarmed(...)``) is checked where that function builds it; or
* ``super().__init__(...)`` inside an exception class of the package that builds its own
  message (a raise of such a class passes data, not a message, so it is not a site itself).

Each site's message must contain the ``**Message contains:**`` text of a docs/errors.md entry
whose ``**Raised:**`` type is the site's, or be allowlisted in :data:`ALLOWED` below, with a
reason. A site whose message has no literal text at all (built wholly at run time) must have an
entry of its type. Conversely every entry must match some site, so a stale entry fails too.

The whole package is walked, the command-line tools (``tools/``) and the teaching ladder
included; the tools' argparse usage errors and exit statuses are in :data:`ALLOWED`.
"""

from __future__ import annotations

import ast
import builtins
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

from docs_snippets import error_entries

import mini_ddp

SRC = Path(mini_ddp.__file__).resolve().parent
HOLE = "\x00"  # stands for a value only known at run time

# Message sites that need no docs/errors.md entry, each identified by a fragment of its
# message (or, for a site with no literal text, of its source expression), with the reason.
ALLOWED: dict[str, str] = {
    "this is a bug in mini_ddp": "internal invariant: the message says it is a bug",
    "is implemented; it cannot also be refused":
        "internal invariant, checked when the package is imported (a refusal table names a "
        "method the class defines)",
    "assign_buckets needs at least one parameter":
        "internal invariant: DataParallelModel refuses a module without trainable parameters "
        "first ('Nothing to train')",
    "no answer within": "a bounded broadcast's timeout: every caller runs it inside "
                        "naming_collective, which raises CollectiveError ('A peer died')",
    "changed while it was opened": "the shared-memory transport turns this OSError into "
                                   "ShmAllocationError ('A shared buffer could not be ...')",
    "not the segment": "as above: becomes ShmAllocationError",
    "bytes, expected": "as above: becomes ShmAllocationError",
    "no checksum footer": "load_checkpoint catches it, logs the damaged file and tries the "
                          "previous one",
    "checksum mismatch (file corrupted)": "as above: load_checkpoint logs it and goes on",
    "SystemExit(main())": "a command's exit status, not an error",
    "the rendezvous store did not answer within": "never reaches the user: every caller on the "
                                                  "observing side turns it into one log line",
    "the rendezvous store failed": "as above: one log line, never raised to the user",
    "not a shape": "an argparse type: argparse prints it as the usage error of --input-shape",
    "unknown --inject-bug": "the parity tool's test-only option (tests/test_parity_cli.py)",
}


@dataclass(frozen=True)
class Site:
    """One place that sets an error's message: its type and its literal text."""

    where: str  # "module.py:line", for the failure message only
    kind: str
    text: str  # literal parts, HOLE between them
    source: str  # the raised expression (to identify a site that has no literal text)


_EXCEPTIONS = {n for n, v in vars(builtins).items()
               if isinstance(v, type) and issubclass(v, BaseException)}


# An exception class from another library (argparse.ArgumentTypeError, torch's DistError).
_EXCEPTION_NAME = re.compile(r"[A-Z]\w*(Error|Exception|Exit|Timeout|Interrupt)$")


def _strings(node: ast.AST) -> dict[str, str]:
    """Names bound to a string directly in ``node``'s body (module or function level)."""
    found: dict[str, str] = {}
    for stmt in ast.walk(node) if isinstance(node, ast.FunctionDef) else node.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target, value = stmt.targets[0], stmt.value
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            target, value = stmt.target, stmt.value
        else:
            continue
        if isinstance(target, ast.Name):
            text = _text(value, {})
            if _literal(text):
                found[target.id] = text
    return found


def _text(node: ast.AST | None, names: dict[str, str]) -> str:
    """The literal text of a message expression, HOLE where a run-time value goes."""
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, str) else HOLE
    if isinstance(node, ast.JoinedStr):
        return "".join(_text(v, names) for v in node.values)
    if isinstance(node, ast.FormattedValue):
        return _text(node.value, names) if isinstance(node.value, ast.Name) else HOLE
    if isinstance(node, ast.Name):
        return names.get(node.id, HOLE)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _text(node.left, names) + _text(node.right, names)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        return _text(node.left, names) + HOLE
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "format"):  # "... {} ...".format(value)
        return _text(node.func.value, names) + HOLE
    if isinstance(node, ast.IfExp):
        return _text(node.body, names) + HOLE + _text(node.orelse, names)
    return HOLE


def _call_text(call: ast.Call, names: dict[str, str]) -> str:
    parts = [_text(a, names) for a in call.args] + [_text(k.value, names) for k in call.keywords]
    return HOLE.join(parts)


def _callee(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _dotted(where: str) -> str:
    """``engine/comm.py`` -> ``mini_ddp.engine.comm`` (a package's ``__init__``: the package)."""
    return ".".join(["mini_ddp", *Path(where).with_suffix("").parts]).removesuffix(".__init__")


def _is_super_init(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "__init__" and isinstance(node.func.value, ast.Call)
            and getattr(node.func.value.func, "id", "") == "super")


class Package:
    """What the sites of a set of modules need from all of them: string constants, classes."""

    def __init__(self, modules: dict[str, str]):
        self.trees = {where: ast.parse(source) for where, source in modules.items()}
        self.constants = {where: _strings(tree) for where, tree in self.trees.items()}
        everywhere: dict[str, set[str]] = {}
        for constants in self.constants.values():
            for name, text in constants.items():
                everywhere.setdefault(name, set()).add(text)
        self.unique = {name: texts.pop() for name, texts in everywhere.items() if len(texts) == 1}
        classes = {node.name: node for tree in self.trees.values() for node in ast.walk(tree)
                   if isinstance(node, ast.ClassDef)}
        self.exceptions = set(_EXCEPTIONS)
        while True:  # package classes deriving (indirectly) from an exception
            more = {name for name, node in classes.items() if name not in self.exceptions
                    and any(getattr(b, "id", getattr(b, "attr", "")) in self.exceptions
                            for b in node.bases)}
            if not more:
                break
            self.exceptions |= more
        self.own_message = {name for name in self.exceptions & set(classes)
                            if any(_is_super_init(n) and n.args for n in ast.walk(classes[name]))}
        # Their methods: a super().__init__(message) there is a site of that class.
        self.method_of = {id(m): name for name in self.own_message for m in classes[name].body
                          if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
        self.dotted = {_dotted(where): where for where in self.trees}

    def imported_strings(self, where: str) -> dict[str, str]:
        """The string constants ``where`` imports by name from another module of the package
        (by its import; else, for a name no other module binds to another string, by name)."""
        found: dict[str, str] = {}
        package = _dotted(where).split(".")[: -1 if not where.endswith("__init__.py") else None]
        for node in ast.walk(self.trees[where]):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            source = ".".join(p for p in (base, node.module or "") if p)
            constants = self.constants.get(self.dotted.get(source, ""), {})
            for alias in node.names:
                name = alias.asname or alias.name
                text = constants.get(alias.name, self.unique.get(alias.name))
                if text is not None:
                    found[name] = text
        return found

    def sites(self) -> list[Site]:
        found: dict[tuple[str, str], Site] = {}
        for where, tree in self.trees.items():
            module_names = {**self.imported_strings(where), **self.constants[where]}
            passed = _passed_strings(tree, module_names)
            for scope in [tree, *(n for n in ast.walk(tree)
                                  if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
                for names in _scope_names(scope, tree, module_names, passed):
                    for node in _own_nodes(scope):
                        for site in self._site(where, node, names, scope):
                            found.setdefault((site.where, site.text), site)
        return list(found.values())

    def _site(self, where: str, node: ast.AST, names: dict[str, str], scope: ast.AST
              ) -> list[Site]:
        if _is_super_init(node) and node.args and id(scope) in self.method_of:
            return [Site(f"{where}:{node.lineno}", self.method_of[id(scope)],
                         _call_text(node, names), ast.unparse(node))]
        if not isinstance(node, ast.Raise):
            return []
        call = node.exc
        if isinstance(call, ast.Name):  # err = SomeError(...); ...; raise err
            call = next((s.value for s in ast.walk(scope) if isinstance(s, ast.Assign)
                         and isinstance(s.value, ast.Call)
                         and any(getattr(t, "id", None) == call.id for t in s.targets)), None)
        if not isinstance(call, ast.Call):
            return []  # a re-raise of a caught error
        kind = _callee(call)
        if kind in self.own_message or not (kind in self.exceptions or _EXCEPTION_NAME.match(kind)):
            # The class's own __init__ is the site, or a function built the exception (its
            # own raise or constructor call is the site: ``step.unarmed(...)``).
            return []
        return [Site(f"{where}:{node.lineno}", kind, _call_text(call, names), ast.unparse(call))]


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    return [a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)]


def _passed_strings(tree: ast.Module, names: dict[str, str]) -> dict[tuple[str, str], set[str]]:
    """(function, parameter) -> the strings this module's calls of that function pass it
    (as ``self._install(state, hook, TWO_HOOKS)`` passes a message to a helper)."""
    functions = {n.name: n for n in ast.walk(tree)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    passed: dict[tuple[str, str], set[str]] = {}
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        fn = functions.get(_callee(call))
        if fn is None:
            continue
        params = _params(fn)
        if isinstance(call.func, ast.Attribute) and params[:1] in (["self"], ["cls"]):
            params = params[1:]
        bound = [*zip(params, call.args, strict=False),  # a *args call may pass more
                 *((k.arg, k.value) for k in call.keywords)]
        for param, value in bound:
            text = _text(value, names)
            if param and _literal(text):
                passed.setdefault((fn.name, param), set()).add(text)
    return passed


def _scope_names(scope: ast.AST, tree: ast.Module, module_names: dict[str, str],
                 passed: dict[tuple[str, str], set[str]]) -> list[dict[str, str]]:
    """The name -> string maps to read ``scope``'s messages with: one per combination of the
    strings its callers pass its parameters (a parameter nobody passes a string is a value)."""
    if scope is tree:
        return [module_names]
    params = _params(scope)
    names = {n: t for n, t in module_names.items() if n not in params}
    names.update(_strings(scope))
    combos = [names]
    for param in params:
        texts = sorted(passed.get((scope.name, param), ()))
        if texts:
            combos = [{**c, param: t} for c in combos for t in texts]
    return combos


def _own_nodes(scope: ast.AST):
    """Nodes of ``scope`` that belong to no nested function (those are scopes of their own)."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


def package_sources() -> dict[str, str]:
    return {str(p.relative_to(SRC)): p.read_text() for p in sorted(SRC.rglob("*.py"))
            if "__pycache__" not in p.parts}


def _literal(text: str) -> bool:
    """Whether a site's message has literal words (else only its type can be checked)."""
    return re.search(r"\w", text) is not None


def _matches(site: Site, kind: str, text: str) -> bool:
    if site.kind != kind:
        return False
    return text in site.text if _literal(site.text) else True


def undocumented(sites: list[Site], entries: list[tuple[str, str, str]],
                 allowed: dict[str, str]) -> list[Site]:
    """The sites no entry matches and no allowlisted fragment names."""
    def is_allowed(site: Site) -> bool:
        haystack = site.text if _literal(site.text) else site.source
        return any(fragment in haystack for fragment in allowed)
    return [s for s in sites if not is_allowed(s)
            and not any(_matches(s, kind, text) for _, kind, text in entries)]


def _show(site: Site) -> str:
    return f"{site.where}: {site.kind}: {site.text.replace(HOLE, '…')[:160]!r}"


def test_every_raise_site_is_documented():
    sites = Package(package_sources()).sites()
    assert len(sites) > 50, "the walk found too few raise sites: is SRC right?"
    missing = undocumented(sites, error_entries(), ALLOWED)
    assert not missing, ("raise sites without a docs/errors.md entry (or an ALLOWED reason):\n"
                         + "\n".join(map(_show, missing)))


def test_every_entry_matches_a_raise_site():
    sites = Package(package_sources()).sites()
    stale = [title for title, kind, text in error_entries()
             if not any(_matches(s, kind, text) and _literal(s.text) for s in sites)
             and not any(s.kind == kind and not _literal(s.text) for s in sites)]
    assert not stale, f"docs/errors.md entries whose text no raise site has: {stale}"


def test_every_allowlisted_fragment_is_still_raised():
    sites = Package(package_sources()).sites()
    gone = [f for f in ALLOWED
            if not any(f in (s.text if _literal(s.text) else s.source) for s in sites)]
    assert not gone, f"ALLOWED names sites that no longer exist: {gone}"


SNIPPET = textwrap.dedent('''
    GREETING = "Default process group has not been initialized"

    class OwnError(RuntimeError):
        def __init__(self, rank):
            super().__init__(f"rank {rank}: something nobody documented")

    def documented():
        raise ValueError(f"{GREETING}, please make sure to call init_process_group")

    def undocumented(x):
        message = f"frobnicated {x} twice"
        raise KeyError(message)

    def wrong_type():
        raise TypeError(GREETING)

    def allowed():
        raise RuntimeError("this is a bug in mini_ddp")

    def data_only():
        raise OwnError(3)

    def third_party():
        raise argparse.ArgumentTypeError("a shape nobody documented")

    def factory():
        raise make_error()  # checked where make_error builds it
''')


def test_the_walk_reports_an_undocumented_raise():
    """The check can fail: a snippet's undocumented raises are reported, the others not."""
    sites = Package({"snippet.py": SNIPPET}).sites()
    assert len(sites) == 6  # OwnError's raise passes data: its __init__ is the site
    missing = undocumented(sites, error_entries(), ALLOWED)
    assert sorted(s.kind for s in missing) == ["ArgumentTypeError", "KeyError", "OwnError",
                                               "TypeError"], [_show(s) for s in missing]
    key_error = next(s for s in missing if s.kind == "KeyError")
    assert "frobnicated" in key_error.text  # resolved through the local variable
    documented = next(s for s in sites if s.where.endswith(":9"))
    assert documented.text.startswith("Default process group has not been initialized, ")


def test_dropping_an_entry_is_noticed():
    """Without the "Second hook" entry, the real walk reports the raise that entry covers."""
    entries = [e for e in error_entries() if e[0] != "Second hook"]
    missing = undocumented(Package(package_sources()).sites(), entries, ALLOWED)
    assert [s.kind for s in missing] == ["RuntimeError"], [_show(s) for s in missing]
    assert "register_comm_hook or register_builtin_comm_hook can only be called once" \
        in missing[0].text


def test_the_walk_follows_a_message_imported_from_another_module():
    """A sentence kept in one module and raised in another (as after code moves) still
    resolves: by the import, also when another module binds the same name to other text."""
    sites = Package({
        "engine/sentences.py": 'TWICE = "Expected to mark a variable ready only once. "\n',
        "engine/other.py": 'TWICE = "something else"\n',
        "engine/raiser.py": "from mini_ddp.engine.sentences import TWICE\n"
                            "def f():\n    raise RuntimeError(f'{TWICE}detail')\n",
        "engine/relative.py": "from .sentences import TWICE as T\n"
                              "def g():\n    raise RuntimeError(T)\n",
    }).sites()
    assert sorted(s.text for s in sites) == ["Expected to mark a variable ready only once. ",
                                             "Expected to mark a variable ready only once. "
                                             "detail"]
