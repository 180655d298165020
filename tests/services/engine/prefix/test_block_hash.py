import pytest

from services.engine.prefix.block_hash import ImageSpan, block_hashes

IDS = list(range(1000, 1300))  # two full blocks of 128 and a partial one


def test_only_full_blocks_are_hashed_and_the_chain_extends_incrementally():
    full = block_hashes(IDS, 128, model="m")
    assert len(full) == 2 and len(set(full)) == 2
    assert block_hashes(IDS, 128, model="m", parent=full[0], first_block=1) == full[1:]
    assert block_hashes(IDS[:255], 128, model="m") == full[:1]


def test_a_change_anywhere_earlier_changes_every_later_hash():
    changed = list(IDS)
    changed[5] += 1
    a, b = block_hashes(IDS, 128, model="m"), block_hashes(changed, 128, model="m")
    assert a[0] != b[0] and a[1] != b[1]
    changed_late = list(IDS)
    changed_late[200] += 1
    c = block_hashes(changed_late, 128, model="m")
    assert c[0] == a[0] and c[1] != a[1]


def test_model_salt_and_image_content_separate_blocks():
    base = block_hashes(IDS, 128, model="m")
    assert block_hashes(IDS, 128, model="other")[0] != base[0]
    assert block_hashes(IDS, 128, model="m", salt="tenant-a")[0] != base[0]
    one = block_hashes(IDS, 128, model="m", images=[ImageSpan(start=130, num_tokens=10, digest=b"cat")])
    other = block_hashes(IDS, 128, model="m", images=[ImageSpan(start=130, num_tokens=10, digest=b"dog")])
    assert one[0] == base[0] and one[1] != base[1] and one[1] != other[1]


def test_hashes_fit_u64_and_bad_arguments_are_refused():
    assert all(0 <= h < 2**64 for h in block_hashes(IDS, 128, model="m"))
    with pytest.raises(ValueError):
        block_hashes(IDS, 0, model="m")
    with pytest.raises(ValueError):
        block_hashes(IDS, 128, model="m", first_block=1)
