"""Makes tests/model a package so its module names cannot clash with same-named tests elsewhere."""
