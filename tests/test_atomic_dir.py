"""`models.atomic_dir`: a directory appears whole or not at all, and a commit killed between its
two renames loses nothing (the previous directory waits as `.<name>.replaced`)."""
from cleaner_jax.models.atomic_dir import commit_dir, partial_dir, recover_replaced


def write(final, text):
    tmp = partial_dir(final)
    (tmp / "f.txt").write_text(text)
    return commit_dir(tmp, final)


def killed_between_renames(final):
    """The state a commit killed after renaming `final` aside and before renaming its new one in."""
    final.rename(final.parent / f".{final.name}.replaced")
    partial_dir(final)


def test_commit_replaces_and_leaves_nothing_beside(tmp_path):
    final = tmp_path / "d"
    write(final, "one")
    write(final, "two")
    assert (final / "f.txt").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_a_killed_commit_is_put_back_by_recover_or_by_the_next_commit(tmp_path):
    final = tmp_path / "d"
    write(final, "one")
    killed_between_renames(final)
    assert not final.exists() and not recover_replaced(tmp_path / "other")
    assert recover_replaced(final) and (final / "f.txt").read_text() == "one"
    assert not recover_replaced(final)  # nothing left to put back
    killed_between_renames(final)
    write(final, "two")  # the next commit replaces the previous directory like any other
    assert (final / "f.txt").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_a_stale_leftover_beside_a_complete_directory_is_not_put_back(tmp_path):
    final = tmp_path / "d"
    write(final, "new")
    (tmp_path / ".d.replaced").mkdir()  # a commit killed after its second rename, before the cleanup
    assert not recover_replaced(final) and (final / "f.txt").read_text() == "new"
    write(final, "newer")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
