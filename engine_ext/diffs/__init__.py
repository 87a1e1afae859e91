"""TokenDance's Master-Mirror storage: a round's sibling caches kept as block-sparse
diffs against one dense master, restored by applying the diff while copying."""

from engine_ext.diffs.images import CacheImage, CanonicalRun
from engine_ext.diffs.restorer import Restore, Restorer
from engine_ext.diffs.store import DiffStore, StoreResult
from engine_ext.diffs.stored import CacheView, MasterView, MirrorView, StoredMaster, StoredMirror

__all__ = ["CacheImage", "CacheView", "CanonicalRun", "DiffStore", "MasterView", "MirrorView", "Restore",
           "Restorer", "StoreResult", "StoredMaster", "StoredMirror"]
