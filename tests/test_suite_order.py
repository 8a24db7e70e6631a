"""The order the test modules run in (tests/conftest.py, LONGEST_FIRST): the names it lists exist, and the test
command keeps that order instead of xdist's own (modules with the most tests first)."""

from conftest import LONGEST_FIRST, ROOT


def test_every_module_named_longest_first_exists_once():
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    missing = [name for name in LONGEST_FIRST if not (ROOT / "tests" / name).is_file()]
    assert not missing, f"tests/conftest.py LONGEST_FIRST names modules that are gone: {missing}"


def test_the_test_command_hands_out_whole_modules_in_collection_order():
    script = (ROOT / "scripts" / "test.sh").read_text()
    assert "--dist loadfile" in script and "--no-loadscope-reorder" in script
