#!/usr/bin/env python3
"""The import graph of a crate's modules, from its `crate::` paths.

Usage: scripts/module-graph.py [SRC_DIR] [--depth N] [--edges]

Run from the repository root: `python3 scripts/module-graph.py` (top-level modules) and
`python3 scripts/module-graph.py --depth 9` (every file).

Each source file is a module (`a/mod.rs` is `a`, `a/b.rs` is `a::b`). An edge A -> B means A names a path under
`crate::B` (in a `use` or inline). Modules are grouped to `--depth` path segments (1: the crate's top-level
modules, the default; 9: every file). Prints the levels (a module stands one level above everything it uses;
level 1 uses nothing), the two-way ties (groups that use each other, directly or around a loop), and the files
over 700 lines, not counting their `#[cfg(test)]` tail; at depth 1, also every use of a module that the
crate root declares after the user (the root lists the layers lowest first).
"""
import os
import re
import sys
from collections import defaultdict

args = [a for a in sys.argv[1:]]
depth = 1
show_edges = "--edges" in args
if "--depth" in args:
    depth = int(args[args.index("--depth") + 1])
positional = [a for i, a in enumerate(args) if not a.startswith("--") and (i == 0 or args[i - 1] != "--depth")]
src = positional[0] if positional else "crates/burn-accelerate/src"

files = {}
for root, _, names in os.walk(src):
    for name in names:
        if name.endswith(".rs"):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, src)[:-3].split(os.sep)
            if rel[-1] == "mod":
                rel = rel[:-1]
            if rel in (["lib"], ["main"]):
                rel = []
            if "tests" in rel:
                # A test module of its own file (`#[cfg(test)] mod tests;`): not part of the crate's structure.
                continue
            files["::".join(rel)] = path
modules = set(files)


def group(module):
    return "::".join(module.split("::")[:depth]) if module else "(root)"


def strip_tests(text):
    at = text.find("#[cfg(test)]\nmod tests")
    return text if at < 0 else text[:at]


def code_only(text):
    """The text without comments (doc links are not imports)."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(line.split("//")[0] if "\"" not in line else line for line in text.splitlines()
                     if not line.lstrip().startswith("//"))


# Names the crate root re-exports (`pub use a::b::{X, Y};`), resolved to the module that holds them.
root_names = {}
lib = files.get("")
if lib:
    for head, names in re.findall(r"pub use ([a-z_:]+)::\{([^}]*)\};", open(lib).read()):
        for name in names.split(","):
            root_names[name.strip()] = head
    for head, name in re.findall(r"pub use ([a-z_:]+)::([A-Za-z_]+);", open(lib).read()):
        root_names[name] = head


# Names each module re-exports from its children (`pub use child::{X, Y};`), so that a path to `a::X`
# reaches the child that defines X rather than `a`'s face.
reexports = {}
for module, path in files.items():
    text = open(path, encoding="utf-8").read()
    for head, names in re.findall(r"pub(?:\(crate\))? use ((?:self::)?[a-z_]+(?:::[a-z_]+)*)::\{([^}]*)\};", text):
        for name in names.split(","):
            name = name.strip().split(" ")[-1]
            if name and name != "self":
                reexports[(module, name)] = head.replace("self::", "")
    for head, name in re.findall(r"pub(?:\(crate\))? use ((?:self::)?[a-z_]+(?:::[a-z_]+)*)::([A-Za-z_][A-Za-z0-9_]*);", text):
        reexports[(module, name)] = head.replace("self::", "")


def resolve(path, depth_left=8):
    """The module that defines what a `crate::` path names."""
    parts = path.split("::")
    if parts[0] in root_names:
        parts = root_names[parts[0]].split("::") + parts
    for n in range(len(parts), 0, -1):
        candidate = "::".join(parts[:n])
        if candidate in modules:
            if n < len(parts) and depth_left > 0:
                head = reexports.get((candidate, parts[n]))
                if head is not None:
                    if head.startswith("crate::"):
                        target = head[len("crate::"):]
                    else:
                        target = (candidate + "::" + head) if candidate else head
                    found = resolve(target + "::" + "::".join(parts[n:]), depth_left - 1)
                    if found:
                        return found
            return candidate
    return None


edges = defaultdict(set)
long_files = []
use_block = re.compile(r"\buse\s+crate::\{([^;]*)\};", re.S)
inline = re.compile(r"\bcrate::((?:[A-Za-z_][A-Za-z0-9_]*)(?:::[A-Za-z_][A-Za-z0-9_]*)*)")
super_path = re.compile(r"\bsuper::((?:[A-Za-z_][A-Za-z0-9_]*)(?:::[A-Za-z_][A-Za-z0-9_]*)*)")
for module, path in files.items():
    text = strip_tests(open(path, encoding="utf-8").read())
    lines = text.count("\n")
    text = code_only(text)
    if lines > 700:
        long_files.append((path, lines))
    targets = []
    for block in use_block.findall(text):
        for item in re.split(r",(?![^{]*\})", block):
            item = item.strip()
            head = re.match(r"([A-Za-z_][A-Za-z0-9_]*(?:::[A-Za-z_][A-Za-z0-9_]*)*)", item)
            if head:
                targets.append(head.group(1))
                inner = re.search(r"::\{(.*)\}", item, re.S)
                if inner:
                    for sub in inner.group(1).split(","):
                        sub = sub.strip().split(" ")[0]
                        if sub and sub != "self":
                            targets.append(head.group(1) + "::" + sub)
    targets += inline.findall(text)
    is_mod_file = path.endswith("mod.rs") or path.endswith("lib.rs")
    parent = module if is_mod_file else "::".join(module.split("::")[:-1])
    if is_mod_file and module:  # a module that names an item of a child it declares uses that child
        body = re.sub(r"^\s*pub(?:\([a-z]+\))? use [^;]*;", "", text, flags=re.M)
        for child in re.findall(r"^\s*(?:pub(?:\([a-z]+\))? )?mod ([a-z_0-9]+);", text, re.M):
            if re.search(r"(?<![:\w])(?:self::)?" + child + r"::", body):
                targets.append(module + "::" + child)
    for rel in super_path.findall(text):
        base = "::".join(module.split("::")[:-1])
        targets.append((base + "::" + rel) if base else rel)
    for target in targets:
        dest = resolve(target)
        if dest is None or dest == module:
            continue
        a, b = group(module), group(dest)
        if a != b and a != "(root)":
            edges[a].add(b)

nodes = sorted({group(m) for m in modules} - {"(root)"})
# Strongly connected components (Tarjan), then levels on the condensed graph.
index, low, on_stack, stack, sccs, counter = {}, {}, set(), [], [], [0]


def connect(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on_stack.add(v)
    for w in edges.get(v, ()):
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
        sccs.append(sorted(comp))


sys.setrecursionlimit(10000)
for v in nodes:
    if v not in index:
        connect(v)
comp_of = {v: i for i, comp in enumerate(sccs) for v in comp}
level = {}
for i, comp in enumerate(sccs):  # Tarjan emits components in reverse topological order
    deps = {comp_of[w] for v in comp for w in edges.get(v, ()) if comp_of[w] != i}
    level[i] = 1 + max((level[d] for d in deps), default=0)

by_level = defaultdict(list)
for i, comp in enumerate(sccs):
    by_level[level[i]].append(" <-> ".join(comp))
print(f"{len(nodes)} modules (depth {depth}), {sum(len(e) for e in edges.values())} edges, "
      f"{max(level.values(), default=0)} levels")
for lv in sorted(by_level, reverse=True):
    print(f"  level {lv:2}: {', '.join(sorted(by_level[lv]))}")
ties = [comp for comp in sccs if len(comp) > 1]
print(f"two-way ties: {len(ties)}")
for comp in ties:
    print("  " + " <-> ".join(comp))
print(f"files over 700 lines (without tests): {len(long_files)}")
for path, lines in long_files:
    print(f"  {path}: {lines}")
# The order the crate root declares its modules in: a module may use only those declared before it.
order = []
if lib and depth == 1:
    order = re.findall(r"^(?:pub(?:\(crate\))? )?mod ([a-z_0-9]+);", open(lib).read(), re.M)
    upward = sorted(
        f"{a} -> {b}" for a in edges for b in edges[a]
        if a in order and b in order and order.index(b) > order.index(a)
    )
    print(f"uses of a module declared later in lib.rs: {len(upward)}")
    for edge in upward:
        print("  " + edge)
if show_edges:
    for a in sorted(edges):
        print(f"{a} -> {', '.join(sorted(edges[a]))}")
