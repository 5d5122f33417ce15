"""Which rank leads each local tier of a bucket job: the lowest rank sharing its host and directory."""

from disttrain.trainer.checkpoint.tiered import tier_identity, tier_leaders


def test_the_lowest_rank_of_each_host_and_directory_leads_its_tier():
    identities = ["pod-a:/ckpt", "pod-b:/ckpt", "pod-a:/ckpt", "pod-c:/ckpt", "pod-b:/ckpt"]
    assert tier_leaders(identities) == {"pod-a:/ckpt": 0, "pod-b:/ckpt": 1, "pod-c:/ckpt": 3}


def test_one_directory_reached_by_two_paths_is_one_tier(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert tier_identity(tmp_path / "real") == tier_identity(tmp_path / "link")
    assert tier_identity(tmp_path / "real") != tier_identity(tmp_path)
