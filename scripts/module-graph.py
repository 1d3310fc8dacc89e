#!/usr/bin/env python3
"""The import graph of a crate's modules, from every module path its code names; `--check` fails on its faults.

Usage: scripts/module-graph.py [SRC_DIR] [--depth N] [--edges] [--tests] [--check] [--self-test]

Run from the repository root: `python3 scripts/module-graph.py` (top-level modules),
`python3 scripts/module-graph.py --depth 9` (every file), `python3 scripts/module-graph.py --check` (the gate),
`python3 scripts/module-graph.py --self-test` (the script against small fake crates in a temporary folder).
SRC_DIR defaults to crates/burn-accelerate/src; the crate is read from its lib.rs (or main.rs) through its
`mod` declarations (`a/b.rs` or `a/b/mod.rs` is module `a::b`, `#[path]` is followed; an inline `mod name { }`
is a module too, whose code counts for the file it sits in); a `.rs` file no `mod` line reaches is left out,
with a warning on stderr.

What it resolves. The code is tokenized first, so that comments (`//`, `/* */`, doc comments) and string
literals (raw ones too, `r"…"`, `r#"…"#`) name nothing. Then every `use` declaration (`pub use`,
`pub(crate) use` re-exports included; grouped and nested trees such as `use super::{a, b::{c, d}, e::*}`,
`as` renames, across lines) and every path written inline that starts with `crate::`, `$crate::`, `self::`,
`super::` (any number of them), the name of a child module the scope declares (`mod foo;` then `foo::bar`),
or a name the scope imports that is a module (`use crate::a::b;` then `b::c`, globs included). A path is
resolved to the longest prefix that is a module; a name after it that the module only imports (or
re-exports) is followed to where it is defined, so that `crate::Accelerator` reaches `accelerator`. A path
that starts with `crate`/`self`/`super`/a child module and cannot be resolved (a `super::` past the crate
root, or a name that no child module, item, macro or import of the module it reaches provides, unless that
module invokes a macro at its top level or glob-imports another crate) fails the run with exit status 2,
naming file, line and path; so does a use declaration it cannot parse. Paths into other crates (`burn::`,
`std::`, …) are left out.

An edge A -> B means code of module A names a path that resolves into module B. Test code is parsed the same
way, but its edges are kept apart (`--tests` prints them) and count for nothing below: modules named `tests`
(files under a `tests/` folder, `tests.rs`, inline `mod tests { }`), every module or item declared under
`#[cfg(test)]`, and every use of a test module. So are the edges of items marked `#[deprecated]`: aliases that
keep a moved public path compiling name its new home without being a use of it.

The report: modules grouped to `--depth` path segments (1: the crate's top-level modules, the default; 9:
every file), their levels (a module stands one level above everything it uses; level 1 uses nothing), the
two-way ties of that grouped graph (groups that use each other, directly or around a loop), the files over
700 lines not counting their `#[cfg(test)] mod tests` tail, the later-declared uses (below; from `--depth 2`
on, the depth-2 ones and the depth-2 sibling ties too), and the count of each kind of violation. `--edges`
adds every edge of the grouped graph; `--tests` the test edges.

`--check` exits 1, printing one line per violation, when there is
  - a tie (a strongly connected group of two or more) among the crate root's modules (depth 1), or among the
    children of one top-level module (depth 2);
  - a later-declared use: module X uses a sibling Y (same parent) that the parent declares after X (depth 1:
    the order of the `mod` lines in lib.rs, the layers lowest first; depth 2: the order in the top-level
    module's own file). A parent and its descendants may name each other freely; a deeper module that uses a
    module elsewhere counts for the pair of siblings under their closest common parent
    (`a::x::deep -> b` is `a -> b`);
  - a source file over 700 lines without its `#[cfg(test)]` tail (test files are not counted);
and otherwise exits 0 printing `module graph: 0 ties, 0 later-declared uses, 0 files over 700 lines`.
Python 3 standard library only.
"""
import os
import subprocess
import sys
import tempfile
from collections import defaultdict

MAX_LINES = 700
DEFAULT_SRC = "crates/burn-accelerate/src"


# ----------------------------------------------------------------------------------------------- tokens

class Tok:
    __slots__ = ("kind", "val", "line")

    def __init__(self, kind, val, line):
        self.kind, self.val, self.line = kind, val, line

    def __repr__(self):
        return f"{self.kind}:{self.val}@{self.line}"


def _ident_char(c):
    return c.isalnum() or c == "_"


def lex(text):
    """Rust tokens without comments; string and char literals become one `lit` token each (their text kept)."""
    toks, i, n, line = [], 0, len(text), 1

    def scan_string(j):  # j at the opening quote; returns the index after the closing one
        j += 1
        while j < n:
            c = text[j]
            if c == "\\":
                j += 2
            elif c == '"':
                return j + 1
            else:
                j += 1
        return n

    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif c.isspace():
            i += 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            line += text.count("\n", i, j)
            i = j
        elif c.isalpha() or c == "_":
            j = i + 1
            while j < n and _ident_char(text[j]):
                j += 1
            word = text[i:j]
            if word in ("r", "br", "cr") and j < n and text[j] in '"#':
                k = j
                while k < n and text[k] == "#":
                    k += 1
                if k < n and text[k] == '"':  # raw string
                    hashes = k - j
                    end = text.find('"' + "#" * hashes, k + 1)
                    end = n if end < 0 else end + 1 + hashes
                    toks.append(Tok("lit", text[k + 1:end - 1 - hashes], line))
                    line += text.count("\n", i, end)
                    i = end
                    continue
                if word == "r" and k == j + 1 and k < n and (text[k].isalpha() or text[k] == "_"):  # r#ident
                    m = k
                    while m < n and _ident_char(text[m]):
                        m += 1
                    toks.append(Tok("id", text[k:m], line))
                    i = m
                    continue
            if word in ("b", "c") and j < n and text[j] == '"':
                end = scan_string(j)
                toks.append(Tok("lit", text[j + 1:end - 1], line))
                line += text.count("\n", i, end)
                i = end
                continue
            if word == "b" and j < n and text[j] == "'":
                end = text.find("'", j + 2 if j + 1 < n and text[j + 1] == "\\" else j + 1)
                end = n if end < 0 else end + 1
                if text[j + 1:j + 2] == "\\" and text[j + 2:j + 3] == "'":
                    end = j + 4
                toks.append(Tok("lit", "b'", line))
                i = end
                continue
            toks.append(Tok("id", word, line))
            i = j
        elif c == '"':
            end = scan_string(i)
            toks.append(Tok("lit", text[i + 1:end - 1], line))
            line += text.count("\n", i, end)
            i = end
        elif c == "'":
            if i + 1 < n and text[i + 1] == "\\":  # '\n', '\'', '\u{..}'
                end = text.find("'", i + 3)
                end = n if end < 0 else end + 1
                toks.append(Tok("lit", "'", line))
                i = end
            elif i + 2 < n and text[i + 2] == "'":  # 'a'
                toks.append(Tok("lit", "'", line))
                i += 3
            else:  # a lifetime or a label
                j = i + 1
                while j < n and _ident_char(text[j]):
                    j += 1
                toks.append(Tok("life", text[i:j], line))
                i = j
        elif c.isdigit():
            j = i + 1
            while j < n and (_ident_char(text[j]) or (text[j] == "." and j + 1 < n and text[j + 1].isdigit())):
                j += 1
            toks.append(Tok("num", text[i:j], line))
            i = j
        elif text.startswith("::", i):
            toks.append(Tok("p", "::", line))
            i += 2
        elif c == "$" and text.startswith("crate", i + 1) and not (i + 6 < n and _ident_char(text[i + 6])):
            toks.append(Tok("id", "$crate", line))
            i += 6
        else:
            toks.append(Tok("p", c, line))
            i += 1
    toks.append(Tok("eof", "", line))
    return toks


# ----------------------------------------------------------------------------------------------- parsing

class Fatal(Exception):
    """A fault that stops the run with exit status 2."""


class Module:
    def __init__(self, path, file, inline, test, decl):
        self.path = path  # tuple of segments; () is the crate root
        self.file = file  # the file its code is in
        self.inline = inline  # an inline `mod name { }`
        self.test = test
        self.decl = decl  # (file, line) of its `mod` line
        self.children = []  # declared child modules, in order
        self.defined = set()  # items defined at its top level
        self.imports = {}  # name -> path segments, for `use` at its top level
        self.globs = []  # path segments of `use …::*` at its top level
        self.local = {}  # `use` inside function bodies: names for inline paths only
        self.local_globs = []
        self.macro_exports = {}  # crate root only: `#[macro_export]` macro -> module that defines it
        self.opaque = False  # invokes a macro at its top level
        self.file_module = path  # the module of the file its code is in (for an inline module, its file's)


class Occurrence:
    __slots__ = ("scope", "segs", "file", "line", "test", "kind")

    def __init__(self, scope, segs, file, line, test, kind):
        self.scope, self.segs, self.file, self.line, self.test, self.kind = scope, segs, file, line, test, kind

    @property
    def text(self):
        return "::".join(self.segs)


DEFINERS = {"fn", "struct", "enum", "trait", "type", "const", "static", "union"}


def _is_cfg_test(attr):
    """`cfg(test)` or `cfg(all(…, test, …))`."""
    vals = [t.val for t in attr]
    if vals == ["cfg", "(", "test", ")"]:
        return True
    if vals[:4] == ["cfg", "(", "all", "("]:
        depth = 0
        for v in vals[3:]:
            if v == "(":
                depth += 1
            elif v == ")":
                depth -= 1
            elif v == "test" and depth == 1:
                return True
    return False


def _matching(toks, i, open_, close):
    depth = 0
    while toks[i].kind != "eof":
        if toks[i].val == open_:
            depth += 1
        elif toks[i].val == close:
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return i


def _parse_use_tree(toks, i, prefix, file, grouped=False):
    """Leaves of a use tree at toks[i], and the index after: (segments, line, is_glob, bound name or None,
    whether the leaf sits in a `{ }` group)."""
    leaves = []
    if not prefix and toks[i].val == "::":
        prefix, i = ["::"], i + 1
    while True:
        t = toks[i]
        if t.val == "{":
            i += 1
            while toks[i].val != "}":
                if toks[i].kind == "eof":
                    raise Fatal(f"{file}:{t.line}: cannot parse the use declaration (no closing `}}`)")
                i, sub = _parse_use_tree(toks, i, prefix, file, True)
                leaves += sub
                if toks[i].val == ",":
                    i += 1
                elif toks[i].val != "}":
                    raise Fatal(f"{file}:{toks[i].line}: cannot parse the use declaration at `{toks[i].val}`")
            return i + 1, leaves
        if t.val == "*":
            leaves.append((prefix, t.line, True, None, grouped))
            return i + 1, leaves
        if t.kind == "id":
            i += 1
            if toks[i].val == "::":
                prefix, i = prefix + [t.val], i + 1
                continue
            name = t.val
            if toks[i].val == "as":
                name, i = toks[i + 1].val, i + 2
            if t.val == "self":
                if not prefix:
                    raise Fatal(f"{file}:{t.line}: cannot parse the use declaration (`self` alone)")
                leaves.append((prefix, t.line, False, prefix[-1] if name == "self" else name, grouped))
            else:
                leaves.append((prefix + [t.val], t.line, False, name, grouped))
            return i, leaves
        raise Fatal(f"{file}:{t.line}: cannot parse the use declaration at `{t.val}`")


class Crate:
    def __init__(self, src):
        self.src = src
        self.mods = {}
        self.occurrences = []
        self.code_lines = {}  # file -> lines without the #[cfg(test)] tail
        self.warnings = []
        root_file = next((os.path.join(src, f) for f in ("lib.rs", "main.rs")
                          if os.path.exists(os.path.join(src, f))), None)
        if root_file is None:
            raise Fatal(f"{src}: no lib.rs or main.rs")
        self.root_file = root_file
        self._add_module((), root_file, False, False, None)
        self._parse_file(root_file, (), False)
        seen = {os.path.normpath(m.file) for m in self.mods.values()}
        for root, _, names in os.walk(src):
            for name in sorted(names):
                path = os.path.normpath(os.path.join(root, name))
                if name.endswith(".rs") and path not in seen:
                    self.warnings.append(f"{path}: no `mod` line declares it, left out")

    def _add_module(self, path, file, inline, test, decl):
        m = Module(path, file, inline, test, decl)
        parent = self.mods.get(path[:-1]) if path else None
        m.file_module = parent.file_module if inline and parent else path
        self.mods[path] = m
        return m

    def _child_file(self, file, inline_chain, name, path_attr, line):
        base_name = os.path.basename(file)
        here = os.path.dirname(file)
        if path_attr is not None:
            return os.path.normpath(os.path.join(here, *inline_chain, path_attr))
        if base_name not in ("lib.rs", "main.rs", "mod.rs"):
            here = os.path.join(here, base_name[:-3])
        here = os.path.join(here, *inline_chain)
        for candidate in (os.path.join(here, name + ".rs"), os.path.join(here, name, "mod.rs")):
            if os.path.exists(candidate):
                return candidate
        return None

    def _parse_file(self, file, module, test):
        with open(file, encoding="utf-8") as f:
            text = f.read()
        toks = lex(text)
        tail_line = None
        # frames: (module path, nesting inside its braces, test, inline names from the file's module)
        frames = [(module, 0, test, ())]
        nesting = 0
        region = None  # nesting of the `#[cfg(test)]` item being read
        region_item = False  # whether that item stands at a module's scope
        pending = {"test": False, "test_line": None, "export": False, "path": None}
        children = []  # (file, module, test) of the child files, parsed after this one
        prev = None
        macro_end = -1
        i = 0
        while toks[i].kind != "eof":
            t = toks[i]
            scope, base, ftest, chain = frames[-1]
            mod = self.mods[scope]
            in_test = ftest or region is not None
            at_scope = nesting == base
            if t.val == "#" and toks[i + 1].val in ("[", "!"):
                inner = toks[i + 1].val == "!"
                start = i + 2 if inner else i + 1
                if toks[start].val != "[":
                    i += 1
                    continue
                end = _matching(toks, start, "[", "]")
                attr = toks[start + 1:end]
                if _is_cfg_test(attr) or (attr and attr[0].val == "deprecated"):
                    if inner:
                        frames[-1] = (scope, base, True, chain)
                        mod.test = True
                    else:
                        pending["test"], pending["test_line"] = True, t.line
                elif attr and attr[0].val == "macro_export":
                    pending["export"] = True
                elif len(attr) == 3 and attr[0].val == "path" and attr[1].val == "=" and attr[2].kind == "lit":
                    pending["path"] = attr[2].val
                prev = toks[end]
                i = end + 1
                continue
            if t.val == "pub":  # visibility, `pub(in crate::a)` included: names nothing
                i = _matching(toks, i + 1, "(", ")") + 1 if toks[i + 1].val == "(" else i + 1
                prev = toks[i - 1]
                continue
            item = dict(pending)
            pending.update(test=False, test_line=None, export=False, path=None)
            if item["test"] and t.val != "mod" and region is None and not ftest:
                region = nesting
                # An item at a module's scope ends at its `;` or its closing brace (a `,` there is a generic
                # parameter's); a field or variant inside braces at its `,`.
                region_item = at_scope
                in_test = True
            if t.val == "mod" and toks[i + 1].kind == "id" and toks[i + 2].val in (";", "{"):
                name, line = toks[i + 1].val, toks[i + 1].line
                child = scope + (name,)
                ctest = in_test or item["test"] or name == "tests"
                if item["test"] and name == "tests" and len(frames) == 1 and nesting == 0 and tail_line is None:
                    tail_line = item["test_line"]
                again = child in self.mods  # declared twice, under two `#[cfg]`s
                if not again:
                    mod.children.append(name)
                if toks[i + 2].val == ";" and again:
                    self.warnings.append(f"{file}:{line}: `mod {name};` declared again, its first file kept")
                elif toks[i + 2].val == ";":
                    cfile = self._child_file(file, chain, name, item["path"], line)
                    if cfile is None:
                        self.warnings.append(f"{file}:{line}: no file for `mod {name};`, left out")
                        mod.children.pop()
                    else:
                        self._add_module(child, cfile, False, ctest, (file, line))
                        children.append((cfile, child, ctest))
                if toks[i + 2].val == ";":
                    prev = toks[i + 2]
                    i += 3
                    continue
                if not again:
                    self._add_module(child, file, True, ctest, (file, line))
                nesting += 1
                frames.append((child, nesting, ctest, chain + (name,)))
                prev = toks[i + 2]
                i += 3
                continue
            if t.val == "use":
                try:
                    j, leaves = _parse_use_tree(toks, i + 1, [], file)
                    if toks[j].val != ";":
                        raise Fatal(f"{file}:{toks[j].line}: cannot parse the use declaration (no `;`)")
                except Fatal:
                    if i < macro_end:  # `use $path;` in a macro's body: not a path yet
                        prev = t
                        i += 1
                        continue
                    raise
                for segs, line, glob, name, grouped in leaves:
                    kind = "use-group" if grouped else "use"
                    self.occurrences.append(Occurrence(scope, segs, file, line, in_test, kind))
                    if glob:
                        (mod.globs if at_scope else mod.local_globs).append(segs)
                    elif name != "_":
                        (mod.imports if at_scope else mod.local)[name] = segs
                prev = toks[j - 1]
                i = j  # the `;` is read below, and may end a #[cfg(test)] item
                continue
            if t.val == "macro_rules" and toks[i + 1].val == "!" and toks[i + 2].kind == "id":
                if toks[i + 3].val in "{([" and toks[i + 3].kind == "p":
                    macro_end = _matching(toks, i + 3, toks[i + 3].val, {"{": "}", "(": ")", "[": "]"}[toks[i + 3].val])
                if at_scope:
                    mod.defined.add(toks[i + 2].val)
                if item["export"]:
                    self.mods[()].macro_exports[toks[i + 2].val] = scope
                prev = toks[i + 2]
                i += 3
                continue
            if t.kind == "id" and toks[i + 1].val == "!" and at_scope and toks[i + 2].val in ("{", "(", "["):
                mod.opaque = True  # a macro invoked at the top level may define items of any name
            if t.kind == "id" and t.val in DEFINERS and (at_scope or i < macro_end):
                k = i + 1
                while toks[k].val in ("mut", "fn", "unsafe", "async", "extern") or toks[k].kind == "lit":
                    k += 1
                if toks[k].kind == "id" and toks[k].val != "_" and (t.val != "union" or toks[k + 1].val in "{<"):
                    mod.defined.add(toks[k].val)
            if t.val == "extern" and toks[i + 1].val == "crate" and at_scope:
                k = i + 2
                name = toks[k].val
                if toks[k + 1].val == "as":
                    name = toks[k + 2].val
                mod.imports[name] = ["::", toks[k].val]
            if (t.kind == "id" and toks[i + 1].val == "::" and toks[i + 2].kind == "id"
                    and (prev is None or prev.val != "::") and not t.val[0].isupper()):
                segs, j = [t.val], i
                while toks[j + 1].val == "::" and toks[j + 2].kind == "id":
                    segs.append(toks[j + 2].val)
                    j += 2
                self.occurrences.append(Occurrence(scope, segs, file, t.line, in_test, "path"))
                prev = toks[j]
                i = j + 1
                continue
            if t.val in "{([" and t.kind == "p":
                nesting += 1
            elif t.val in "})]" and t.kind == "p":
                nesting -= 1
                if t.val == "}" and len(frames) > 1 and nesting < frames[-1][1]:
                    frames.pop()
                if region is not None and (nesting < region or (t.val == "}" and nesting == region)):
                    region = None
            elif (t.val == ";" or (t.val == "," and not region_item)) and region is not None and nesting == region:
                region = None
            prev = t
            i += 1
        self.code_lines[file] = (tail_line - 1) if tail_line else text.count("\n")
        for cfile, child, ctest in children:
            self._parse_file(cfile, child, ctest)

    # ------------------------------------------------------------------------------------------- resolving

    def _glob_module(self, scope, segs, seen):
        """The module a glob import's path names, or None (an enum, another crate)."""
        r = self.resolve(scope, segs, seen, strict=False)
        return r[0] if r and r[1] else None

    def _provides(self, path, name, seen):
        m = self.mods[path]
        if name in m.children or name in m.defined or name in m.imports or (not path and name in m.macro_exports):
            return True
        for g in m.globs:
            key = (path, "*", tuple(g))
            if key in seen:
                continue
            gm = self._glob_module(path, g, seen | {key})
            if gm is not None and self._provides(gm, name, seen | {key}):
                return True
        return False

    def _start(self, scope, name, seen):
        """The module a path's first segment names in `scope` (a child, or an imported module), else None."""
        m = self.mods[scope]
        if name in m.children:
            return scope + (name,)
        segs = m.imports.get(name) or m.local.get(name)
        if segs is not None:
            key = (scope, "^", name)
            if key in seen:
                return None
            r = self.resolve(scope, segs, seen | {key}, strict=False)
            return r[0] if r and r[1] else None
        for g in m.globs + m.local_globs:
            key = (scope, "*", tuple(g))
            if key in seen:
                continue
            gm = self._glob_module(scope, g, seen | {key})
            if gm is not None:
                if name in self.mods[gm].children:
                    return gm + (name,)
                if name in self.mods[gm].imports:
                    r = self.resolve(gm, self.mods[gm].imports[name], seen | {key}, strict=False)
                    if r and r[1]:
                        return r[0]
        return None

    def resolve(self, scope, segs, seen=frozenset(), strict=True):
        """(module, whether the whole path is that module), or None for a path into another crate.

        Raises Fatal-worthy ValueError (its message says why) when the path cannot be resolved."""
        if len(seen) > 64:
            return None
        head = segs[0]
        if head == "::":
            return None
        if head in ("crate", "$crate"):
            cur, rest = (), segs[1:]
        elif head == "self":
            cur, rest = scope, segs[1:]
        elif head == "super":
            cur, rest = scope, segs
        else:
            cur = self._start(scope, head, seen)
            if cur is None:
                return None
            rest = segs[1:]
        while rest and rest[0] == "super":
            if not cur:
                raise ValueError("`super::` goes past the crate root")
            cur, rest = cur[:-1], rest[1:]
        while rest:
            name, m = rest[0], self.mods[cur]
            if name in m.children:
                cur, rest = cur + (name,), rest[1:]
                continue
            if name in m.defined:
                return cur, False
            if not cur and name in m.macro_exports:
                return m.macro_exports[name], False
            key = (cur, name)
            if key in seen:
                return cur, False
            if name in m.imports:
                return self.resolve(cur, m.imports[name] + rest[1:], seen | {key}, strict)
            external_glob = False
            for g in m.globs:
                gm = self._glob_module(cur, g, seen | {key})
                if gm is None:
                    external_glob = True
                elif self._provides(gm, name, seen | {key}):
                    return self.resolve(gm, ["self"] + rest, seen | {key}, strict)
            if strict and not external_glob and not m.opaque and name != "self":
                where = "::".join(cur) or "the crate root"
                raise ValueError(f"no module, item or import `{name}` in `{where}`")
            return cur, False
        return cur, True


# ----------------------------------------------------------------------------------------------- graph

def sccs_of(nodes, edges):
    """Strongly connected components (Tarjan), in reverse topological order."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]

    def connect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            connect(v)
    return out


def name(path):
    return "::".join(path) if path else "(root)"


class Graph:
    def __init__(self, crate):
        self.crate = crate
        self.edges = {}  # (src, dst) file modules -> first (file, line, path) that makes it
        self.test_edges = {}
        failures = []
        for occ in crate.occurrences:
            try:
                r = crate.resolve(occ.scope, occ.segs)
            except ValueError as why:
                failures.append(f"{occ.file}:{occ.line}: cannot resolve `{occ.text}`: {why}")
                continue
            if r is None:
                continue
            src_mod, dst_mod = crate.mods[occ.scope], crate.mods[r[0]]
            src, dst = src_mod.file_module, dst_mod.file_module
            if src == dst:
                continue
            test = occ.test or src_mod.test or dst_mod.test or crate.mods[dst].test
            target = self.test_edges if test else self.edges
            where = (occ.file, occ.line, occ.text)
            if (src, dst) not in target or where < target[(src, dst)]:
                target[(src, dst)] = where
        if failures:
            raise Fatal("\n".join(failures))
        self.modules = sorted(p for p, m in crate.mods.items() if not m.inline and not m.test)

    def grouped(self, depth, test=False):
        out = defaultdict(dict)
        for (a, b), where in (self.test_edges if test else self.edges).items():
            ga, gb = a[:depth], b[:depth]
            if ga == gb or (not test and (not ga or not gb)):
                continue
            if gb not in out[ga] or where < out[ga][gb]:
                out[ga][gb] = where
        return out

    def sibling_pairs(self, level):
        """Edges between siblings under one parent at `level` (1: the root's modules): (parent, a, b) -> where."""
        out = {}
        for (a, b), where in self.edges.items():
            c = 0
            while c < min(len(a), len(b)) and a[c] == b[c]:
                c += 1
            if c == len(a) or c == len(b) or c + 1 != level:  # a parent and its descendants, or deeper
                continue
            key = (a[:c], a[:c + 1], b[:c + 1])
            if key not in out or where < out[key]:
                out[key] = where
        return out

    def violations(self):
        ties, later, long_files = [], [], []
        for level in (1, 2):
            pairs = self.sibling_pairs(level)
            by_parent = defaultdict(lambda: defaultdict(set))
            for (parent, a, b) in pairs:
                by_parent[parent][a].add(b)
            for parent in sorted(by_parent):
                edges = by_parent[parent]
                nodes = set(edges) | {b for bs in edges.values() for b in bs}
                for comp in sccs_of(nodes, edges):
                    if len(comp) > 1:
                        ties.append((level, parent, comp))
            for (parent, a, b), where in sorted(pairs.items()):
                order = self.crate.mods[parent].children
                if a[-1] in order and b[-1] in order and order.index(b[-1]) > order.index(a[-1]):
                    later.append((level, parent, a, b, where))
        for path in self.modules:
            m = self.crate.mods[path]
            lines = self.crate.code_lines[m.file]
            if lines > MAX_LINES:
                long_files.append((m.file, lines))
        return ties, later, long_files


def describe(ties, later, long_files, crate):
    lines = []
    for level, parent, comp in ties:
        where = "" if level == 1 else f", in {name(parent)}"
        lines.append(f"tie (depth {level}{where}): {' <-> '.join(name(c) for c in comp)}")
    for level, parent, a, b, (file, line, text) in later:
        pfile = os.path.relpath(crate.mods[parent].file, crate.src)
        lines.append(f"later-declared use (depth {level}): {name(a)} -> {name(b)} "
                     f"({pfile} declares {b[-1]} after {a[-1]}), e.g. {file}:{line} `{text}`")
    for file, count in long_files:
        lines.append(f"file over {MAX_LINES} lines: {file}: {count} lines without its #[cfg(test)] tail")
    return lines


def summary(ties, later, long_files):
    return (f"module graph: {len(ties)} ties, {len(later)} later-declared uses, "
            f"{len(long_files)} files over {MAX_LINES} lines")


def report(graph, depth, show_edges, show_tests):
    crate = graph.crate
    edges = graph.grouped(depth)
    nodes = sorted({p[:depth] for p in graph.modules} - {()})
    sccs = sccs_of(nodes, edges)
    comp_of = {v: i for i, comp in enumerate(sccs) for v in comp}
    level = {}
    for i, comp in enumerate(sccs):  # Tarjan emits components in reverse topological order
        deps = {comp_of[w] for v in comp for w in edges.get(v, ()) if comp_of[w] != i}
        level[i] = 1 + max((level[d] for d in deps), default=0)
    by_level = defaultdict(list)
    for i, comp in enumerate(sccs):
        by_level[level[i]].append(" <-> ".join(name(c) for c in comp))
    print(f"{len(nodes)} modules (depth {depth}), {sum(len(e) for e in edges.values())} edges, "
          f"{max(level.values(), default=0)} levels")
    for lv in sorted(by_level, reverse=True):
        print(f"  level {lv:2}: {', '.join(sorted(by_level[lv]))}")
    ties = [comp for comp in sccs if len(comp) > 1]
    print(f"two-way ties: {len(ties)}")
    for comp in ties:
        print("  " + " <-> ".join(name(c) for c in comp))
    vties, later, long_files = graph.violations()
    print(f"files over {MAX_LINES} lines (without tests): {len(long_files)}")
    for path, lines in long_files:
        print(f"  {path}: {lines}")
    later1 = [v for v in later if v[0] == 1]
    print(f"uses of a module declared later in {os.path.basename(crate.root_file)}: {len(later1)}")
    for _, _, a, b, _ in later1:
        print(f"  {name(a)} -> {name(b)}")
    if depth >= 2:
        ties2 = [v for v in vties if v[0] == 2]
        print(f"two-way ties between siblings (depth 2): {len(ties2)}")
        for _, parent, comp in ties2:
            print(f"  {' <-> '.join(name(c) for c in comp)}")
        later2 = [v for v in later if v[0] == 2]
        print(f"uses of a sibling declared later (depth 2): {len(later2)}")
        for _, _, a, b, _ in later2:
            print(f"  {name(a)} -> {name(b)}")
    counts = defaultdict(int)
    for v in vties:
        counts[("ties", v[0])] += 1
    for v in later:
        counts[("later", v[0])] += 1
    print(f"violations (what --check fails on): {len(vties)} ties (depth 1: {counts[('ties', 1)]}, depth 2: "
          f"{counts[('ties', 2)]}), {len(later)} later-declared uses (depth 1: {counts[('later', 1)]}, depth 2: "
          f"{counts[('later', 2)]}), {len(long_files)} files over {MAX_LINES} lines")
    if show_tests:
        tedges = graph.grouped(depth, test=True)
        print(f"test edges (not checked): {sum(len(e) for e in tedges.values())}")
        for a in sorted(tedges):
            print(f"  {name(a)} -> {', '.join(sorted(name(b) for b in tedges[a]))}")
    if show_edges:
        for a in sorted(edges):
            print(f"{name(a)} -> {', '.join(sorted(name(b) for b in edges[a]))}")


# ----------------------------------------------------------------------------------------------- self-test

SELF_TEST_CRATE = {
    "lib.rs": """
        //! Doc: `crate::late::Z` and [`top`] name nothing.
        pub mod base;
        mod mid;
        mod alpha;
        mod beta;
        mod early;
        mod late;
        pub mod top;
        mod long;
        mod short_tail;
        pub use base::inner::G;
        pub use mid::a::deep::Deep as Renamed;
    """,
    "base/mod.rs": """
        mod inner;
        mod helper;
        #[cfg(test)]
        mod tests;
        // use crate::top::Commented;
        /* crate::top::Block /* nested crate::top::N */ */
        /// [`crate::top::Doc`]
        pub fn f() -> &'static str {
            let _ = self::inner::g();
            let _ = helper::h();
            let _c = 'x';
            let _q = '\\'';
            "crate::top::InString"
        }
        pub fn raw() -> &'static str { r#"super::top::Raw "quoted" crate::top::R"# }
        #[macro_export]
        macro_rules! m { () => { $crate::base::f() }; }
    """,
    "base/inner.rs": "pub struct G;\npub fn g() {}\n",
    "base/helper.rs": "pub fn h() {}\n",
    "base/tests.rs": "use super::*;\nuse crate::top::T;\n#[test]\nfn t() { let _ = f(); let _ = T; }\n",
    "mid/mod.rs": "pub mod a;\npub mod b;\n",
    "mid/a.rs": """
        pub mod deep;
        use super::{
            b::{X, Y as Z},
            *,
        };
        pub struct A;
        fn use_them() { let _ = (X, Z); }
    """,
    "mid/a/deep.rs": """
        pub struct Deep;
        pub fn d() {
            super::super::super::base::f();
            let _ = crate::top::T;
        }
    """,
    "mid/b.rs": """
        pub struct X;
        pub struct Y;
        pub fn b() { let _ = super::a::A; }
        mod inline_child {
            use super::super::a::deep as d;
            fn x() { d::d(); }
        }
    """,
    "alpha.rs": "use crate::beta::B;\npub struct A;\nfn f() -> B { B }\n",
    "beta.rs": "use crate::alpha::A;\npub struct B;\nfn f() -> A { A }\n",
    "early.rs": """
        use crate::late::L;
        pub fn e() -> L { L }
        #[cfg(test)]
        mod tests {
            use super::*;
            use crate::{late::{L as L2, Other}, top::T};
        }
    """,
    "late.rs": "pub struct L;\npub struct Other;\nfn f() { crate::m!(); }\n",
    "long.rs": "pub fn f() {}\n" * 710 + "#[cfg(test)]\nmod tests {}\n",
    "short_tail.rs": "pub fn f() {}\n" * 650 + "#[cfg(test)]\nmod tests {\n" + "    fn t() {}\n" * 100 + "}\n",
    "top.rs": """
        use crate::{
            base::{inner::G, self as the_base},
            mid::{a::deep::{self as dp, Deep}, b},
            G as RootG, Renamed,
        };
        pub struct T;
        fn f() { the_base::f(); dp::d(); b::b(); let _ = (G, RootG, Renamed, Deep); }
    """,
}

CLEAN_CRATE = {
    "lib.rs": "mod low;\nmod high;\n",
    "low.rs": (
        "pub struct L;\n"
        "// A moved path kept compiling: its aliases name the new home without using it.\n"
        "#[deprecated(note = \"moved\")]\n"
        "pub type H = fn() -> crate::high::Out;\n"
        "#[deprecated]\n"
        "pub fn old<A, const N: usize>(a: A) -> crate::high::Out { crate::high::h2(a) }\n"
        "#[cfg(test)]\n"
        "fn generic_test<A, B>(_: A, _: B) { crate::high::h(); }\n"
    ),
    "high.rs": (
        "use crate::low::L;\nuse super::low;\npub struct Out;\npub fn h() -> L { low::L }\n"
        "pub fn h2<A>(_: A) -> Out { Out }\n"
    ),
}

BAD_CRATE = {
    "lib.rs": "mod a;\n",
    "a.rs": "pub fn f() {\n    // super::super::super::comment is fine\n    super::super::super::x();\n}\n",
}

BAD_TEST_CRATE = {
    "lib.rs": "mod a;\n",
    "a.rs": "pub fn f() {}\n#[cfg(test)]\nmod tests {\n    use super::super::super::nope;\n}\n",
}

BAD_NAME_CRATE = {
    "lib.rs": "mod a;\nmod b;\n",
    "a.rs": "pub fn f() {}\n",
    "b.rs": "use crate::a::missing;\n",
}


def self_test():
    import textwrap
    me = os.path.abspath(__file__)
    failures, checks = [], [0]

    def write(root, files):
        for rel, body in files.items():
            path = os.path.join(root, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(textwrap.dedent(body).lstrip("\n"))

    def run(src, *args):
        p = subprocess.run([sys.executable, me, src, *args], capture_output=True, text=True)
        return p.returncode, p.stdout + p.stderr

    def expect(what, ok, out=""):
        checks[0] += 1
        if not ok:
            failures.append(f"FAILED: {what}\n" + textwrap.indent(out, "    | "))

    with tempfile.TemporaryDirectory() as tmp:
        crates = {}
        for label, files in (("fake", SELF_TEST_CRATE), ("clean", CLEAN_CRATE), ("bad", BAD_CRATE),
                             ("badtest", BAD_TEST_CRATE), ("badname", BAD_NAME_CRATE)):
            crates[label] = os.path.join(tmp, label, "src")
            write(crates[label], files)
        fake = crates["fake"]

        rc, out = run(fake, "--depth", "9", "--edges", "--tests")
        edges = {}
        for line in out.splitlines():
            if " -> " in line and not line.startswith(" "):
                a, bs = line.split(" -> ")
                edges[a] = set(bs.split(", "))
        tests_at = out.find("test edges")

        def has(a, b):
            return b in edges.get(a, set())

        expect("report exits 0", rc == 0, out)
        expect("self:: path (base -> base::inner)", has("base", "base::inner"), out)
        expect("child module path `helper::h` (base -> base::helper)", has("base", "base::helper"), out)
        expect("grouped super import `use super::{b::{X, Y as Z}, *}` (mid::a -> mid::b)",
               has("mid::a", "mid::b"), out)
        expect("super::super::super (mid::a::deep -> base)", has("mid::a::deep", "base"), out)
        expect("inline path `super::a::A` (mid::b -> mid::a)", has("mid::b", "mid::a"), out)
        expect("inline module with `use super::super::a::deep as d` (mid::b -> mid::a::deep)",
               has("mid::b", "mid::a::deep"), out)
        expect("nested crate group with `self as` (top -> base, base::inner, mid::a::deep, mid::b)",
               {"base", "base::inner", "mid::a::deep", "mid::b"} <= edges.get("top", set()), out)
        expect("no edges from comments, doc comments or strings (base -/-> top)",
               not has("base", "top") and not has("(root)", "top"), out)
        expect("a `#[macro_export]` macro named `crate::m!` is its module's (late -> base)", has("late", "base"), out)
        expect("a root re-export is followed (`crate::G` -> base::inner, `Renamed` -> mid::a::deep)",
               has("top", "base::inner") and has("top", "mid::a::deep"), out)
        test_part = out[tests_at:]
        expect("test edges are listed apart (base::tests -> top, early -> late, early -> top)",
               tests_at >= 0 and "base::tests -> " in test_part and "top" in test_part.split("base::tests -> ")[1]
               .splitlines()[0] and "early -> late, top" in test_part, out)

        rc, out = run(fake, "--check")
        expect("--check exits 1 on the fake crate", rc == 1, out)
        expect("depth-1 tie alpha <-> beta", "tie (depth 1): alpha <-> beta" in out, out)
        expect("depth-1 tie mid <-> top (top's nested crate group, mid::a::deep's `crate::top::T`)",
               "tie (depth 1): mid <-> top" in out, out)
        expect("a file over 700 lines without its test tail is reported, one under it with its tail is not",
               "long.rs: 710 lines" in out and "short_tail.rs" not in out, out)
        expect("depth-2 tie mid::a <-> mid::b", "tie (depth 2, in mid): mid::a <-> mid::b" in out, out)
        expect("depth-1 later-declared use early -> late", "later-declared use (depth 1): early -> late " in out, out)
        expect("depth-1 later-declared use from a deeper module (mid -> top, via mid::a::deep)",
               "later-declared use (depth 1): mid -> top " in out and "mid/a/deep.rs:4" in out, out)
        expect("depth-2 later-declared use mid::a -> mid::b (from the grouped super import)",
               "later-declared use (depth 2): mid::a -> mid::b " in out and "mid/a.rs:3" in out, out)
        expect("test code makes no violation (base -> top, early's tests -> top)",
               "base -> top" not in out and "early -> top" not in out, out)
        expect("exact violation count", summary_line(out) == "module graph: 3 ties, 4 later-declared uses, "
               "1 files over 700 lines", out)

        rc, out = run(crates["clean"], "--check")
        expect("--check exits 0 on a clean crate with the one-line summary (its deprecated aliases and a generic "
               "test function naming a later module count for nothing)",
               rc == 0 and out.strip() == "module graph: 0 ties, 0 later-declared uses, 0 files over 700 lines", out)

        rc, out = run(crates["bad"], "--check")
        expect("unresolvable `super::super::super::x` exits 2 naming file, line and path",
               rc == 2 and "a.rs:3: cannot resolve `super::super::super::x`: `super::` goes past the crate root" in out
               and "comment" not in out, out)
        rc, out = run(crates["badtest"])
        expect("unresolvable path in a test module exits 2 too",
               rc == 2 and "a.rs:4: cannot resolve `super::super::super::nope`: `super::` goes past" in out, out)
        rc, out = run(crates["badname"])
        expect("a name no module provides exits 2",
               rc == 2 and "b.rs:1: cannot resolve `crate::a::missing`" in out, out)

    for f in failures:
        print(f)
    print(f"self-test: {checks[0] - len(failures)} of {checks[0]} checks passed")
    return 1 if failures else 0


def summary_line(out):
    return next((line for line in out.splitlines() if line.startswith("module graph: ")), None)


# ----------------------------------------------------------------------------------------------- main

def main(argv):
    args = list(argv)
    if "--self-test" in args:
        return self_test()
    depth = 1
    if "--depth" in args:
        depth = int(args[args.index("--depth") + 1])
    positional = [a for i, a in enumerate(args) if not a.startswith("--") and (i == 0 or args[i - 1] != "--depth")]
    src = positional[0] if positional else DEFAULT_SRC
    try:
        crate = Crate(src)
        graph = Graph(crate)
    except Fatal as fault:
        for line in str(fault).splitlines():
            print(f"module-graph: {line}", file=sys.stderr)
        return 2
    for warning in crate.warnings:
        print(f"module-graph: warning: {warning}", file=sys.stderr)
    if "--check" in args:
        ties, later, long_files = graph.violations()
        for line in describe(ties, later, long_files, crate):
            print(line)
        print(summary(ties, later, long_files))
        return 1 if ties or later or long_files else 0
    report(graph, depth, "--edges" in args, "--tests" in args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
