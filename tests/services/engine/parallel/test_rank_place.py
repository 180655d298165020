"""Where a launcher's rank sits: torchrun's environment read into rank, group size, device and ports; missing or
inconsistent variables refused by name."""

import pytest

from services.engine.parallel.rank_place import RankPlace, from_launcher

LAUNCHED = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "leader-0.lws", "MASTER_PORT": "29500"}


def test_a_launchers_environment_places_the_rank():
    place = from_launcher(LAUNCHED)
    assert place == RankPlace(rank=5, world_size=8, local_rank=1, rendezvous="env://")
    assert place.device("cuda") == "cuda:1"  # its host's second GPU
    assert place.device("cpu") == "cpu" and place.device("cuda:3") == "cuda:3"
    assert place.port(50100) == 50101 and place.port(0) == 0 and place.port(None) is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"MASTER_ADDR": ""}, "MASTER_ADDR unset"),
        ({"RANK": "x"}, "must be integers"),
        ({"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}, "at least 2 ranks"),
        ({"RANK": "8"}, "do not fit"),
        ({"LOCAL_RANK": "6"}, "do not fit"),
    ],
)
def test_a_bad_environment_is_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        from_launcher({**LAUNCHED, **change})
