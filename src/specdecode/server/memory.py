"""Cross-request memory of the server: one SuffixDecoding global tree for every request.

SuffixDecoding (Oliaro et al., 2024, arXiv 2411.04975) wins most when responses repeat earlier
responses (agents, code edits, self-refinement); that needs the global tree to see *every*
request the server answers, whichever slot ran it. So the server builds one
:class:`~specdecode.suffix_cache.SuffixCache` (thread-safe, bounded: ``max_cached_requests``
responses, oldest evicted first) and hands it to every proposer whose constructor takes a
``global_cache``. With ``--suffix-cache PATH`` it is loaded at start, when the file exists, and
saved there (atomically) on shutdown, so a restarted server drafts well from its first request.

The tree's depth and bound are the server's: they come from the server's ``suffix`` config (its
``-c`` overrides when ``--method suffix``), or from the loaded file. A request asking for another
``max_tree_depth`` is refused by the proposer with a 400.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path

from specdecode import registry
from specdecode.errors import require
from specdecode.models.base import Runner
from specdecode.suffix_cache import SuffixCache

log = logging.getLogger("specdecode.server")


class SharedMemory:
    def __init__(self, path: Path | None = None, suffix_config=None):
        """``suffix_config``: the server's config of the ``suffix`` method (default: its
        defaults); it sets the global tree's depth and bound."""
        self.path = Path(path).expanduser() if path is not None else None
        config = suffix_config or registry.get("suffix").make_config()
        if self.path is not None and self.path.exists():
            cache = SuffixCache.load(self.path, config.max_cached_requests)
            require(cache.max_tree_depth == config.max_tree_depth,
                    f"the suffix cache {self.path} was built with max_tree_depth "
                    f"{cache.max_tree_depth} but the server's suffix config has "
                    f"{config.max_tree_depth}; use the same depth or another --suffix-cache file")
            log.info("loaded %d cached responses (%d tokens) from %s",
                     len(cache.cached_requests), cache.num_cached_tokens, self.path)
        else:
            cache = SuffixCache(config.max_tree_depth, config.max_cached_requests)
        self.global_cache = cache

    def make_proposer(self, method: str, config, runner: Runner):
        """Build a slot's proposer, sharing the global tree with it when it can take one."""
        cls = registry.get(method).proposer
        if "global_cache" in inspect.signature(cls).parameters:
            return cls(config, runner, global_cache=self.global_cache)
        return cls(config, runner)

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.global_cache.save(self.path)
        log.info("saved %d cached responses to %s", len(self.global_cache.cached_requests),
                 self.path)
