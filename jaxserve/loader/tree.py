"""Parameters as nested dicts keyed by path (`nnx.to_pure_dict`): walk them flat, read and write by path.

Loading speaks in parameter paths (`("layers", "3", "self_attn", "q_proj", "kernel")`); NNX states and
Orbax trees are nested dicts of those keys. These four functions are the one place that converts.
"""

from __future__ import annotations

from typing import Iterator

ParamPath = tuple[str, ...]


def flatten(tree: dict, prefix: tuple = ()) -> Iterator[tuple[tuple, object]]:
    """(path, leaf) for every leaf of a nested dict, in its key order."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from flatten(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def nested(flat: dict[tuple, object]) -> dict:
    """The inverse of `flatten`: {path: leaf} as a nested dict."""
    tree: dict = {}
    for path, value in flat.items():
        set_path(tree, path, value, create=True)
    return tree


def get_path(tree: dict, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def set_path(tree: dict, path: tuple, value, create: bool = False) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {}) if create else tree[key]
    tree[path[-1]] = value
