"""Every test file belongs to exactly one tier, as tests/tiers.txt lists it."""
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
TIERS = ("cpu", "gpu", "e2e", "upstream")


def test_every_test_file_is_in_exactly_one_tier():
    listed = {}
    for line in (TESTS / "tiers.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        tier, path = line.split()
        assert tier in TIERS, f"unknown tier {tier!r} for {path}"
        assert path not in listed, f"{path} is listed twice"
        assert path.startswith(f"{tier}/"), f"{path} is listed as {tier} but lives elsewhere"
        listed[path] = tier
    on_disk = {str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py")}
    assert on_disk == set(listed), f"unlisted: {sorted(on_disk - set(listed))}, missing: {sorted(set(listed) - on_disk)}"
