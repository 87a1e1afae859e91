from __future__ import annotations

from engine_ext.kv.hashing import block_hashes, chain_hash, namespace_root


def test_root_depends_on_namespace():
    assert namespace_root("a") != namespace_root("b")
    assert namespace_root("a") == namespace_root("a")
    assert len(namespace_root("a")) == 16


def test_only_full_blocks_are_hashed():
    root = namespace_root("m")
    assert len(block_hashes(root, list(range(15)), 4)) == 3
    assert len(block_hashes(root, list(range(16)), 4)) == 4
    assert block_hashes(root, list(range(3)), 4) == []


def test_hashes_are_chained():
    root = namespace_root("m")
    tokens = list(range(12))
    hashes = block_hashes(root, tokens, 4)
    assert hashes[0] == chain_hash(root, tokens[0:4])
    assert hashes[1] == chain_hash(hashes[0], tokens[4:8])
    assert hashes[2] == chain_hash(hashes[1], tokens[8:12])
    # the same tokens in block 1 without the same history hash differently
    assert chain_hash(root, tokens[4:8]) != hashes[1]


def test_same_tokens_different_namespace_differ():
    tokens = list(range(40))
    a = block_hashes(namespace_root("model-a"), tokens, 8)
    b = block_hashes(namespace_root("model-b"), tokens, 8)
    assert len(a) == len(b) == 5
    assert all(x != y for x, y in zip(a, b))


def test_changing_one_token_changes_that_and_all_later_hashes():
    root = namespace_root("m")
    tokens = list(range(100, 132))
    base = block_hashes(root, tokens, 8)
    changed = list(tokens)
    changed[3] = 7  # inside block 0
    after = block_hashes(root, changed, 8)
    assert all(x != y for x, y in zip(base, after))
    changed2 = list(tokens)
    changed2[17] = 7  # inside block 2
    after2 = block_hashes(root, changed2, 8)
    assert after2[:2] == base[:2]
    assert all(x != y for x, y in zip(base[2:], after2[2:]))


def test_large_token_ids_are_distinguished():
    root = namespace_root("m")
    assert chain_hash(root, [1, 2]) != chain_hash(root, [2, 1])
    assert chain_hash(root, [2**40]) != chain_hash(root, [0])
    assert chain_hash(root, [1, 0]) != chain_hash(root, [1])


def test_incremental_hashing_equals_full():
    root = namespace_root("m")
    tokens = list(range(50))
    full = block_hashes(root, tokens, 8)
    first = block_hashes(root, tokens[:20], 8)
    rest = block_hashes(root, tokens, 8, start=len(first), parent=first[-1])
    assert first + rest == full
