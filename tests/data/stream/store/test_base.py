import pytest

from ds_trhash.data.stream.store import StoreError, relative_name


@pytest.mark.parametrize("bad", ["", "/etc/passwd", "../x.bin", "a/../../x.bin", "a//b", "a/./b", ".", "a\\b", "a\0b"])
def test_only_plain_relative_names_pass(bad):
    with pytest.raises(StoreError, match="is not a plain relative file name"):
        relative_name(bad, "the listing")


def test_plain_names_pass_unchanged():
    assert relative_name("corpora/web/tokens-00000.bin", "x") == "corpora/web/tokens-00000.bin"
