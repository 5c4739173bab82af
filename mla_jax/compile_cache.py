"""JAX's persistent compilation cache, on by default for every engine.

A second start of the same engine configuration (same model config, buckets, backend, jax version and GPU)
loads its compiled steps from disk instead of compiling them again. The directory is, in order: one already
set in jax's config (`JAX_COMPILATION_CACHE_DIR`), `$MLA_JAX_COMPILE_CACHE`, or
`$XDG_CACHE_HOME/mla-jax/jax` (`~/.cache/mla-jax/jax`). `MLA_JAX_COMPILE_CACHE=off` (or `0`, or the CLI's
`--no-compile-cache`) leaves it off.
"""

from __future__ import annotations

import os

import jax

OFF = ("", "0", "off", "false", "no")


def default_dir() -> str:
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(home, "mla-jax", "jax")


def enable_compile_cache(path: str | None = None) -> str | None:
    """Turn the persistent compilation cache on (idempotent); returns its directory, or None when it is off.
    `path` overrides the environment; a directory jax already has is kept."""
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    if path is None:
        env = os.environ.get("MLA_JAX_COMPILE_CACHE")
        if env is not None and env.strip().lower() in OFF:
            return None
        path = env or default_dir()
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    return path
