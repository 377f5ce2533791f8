"""Every exception class the package defines is an expected refusal (a ``UserError``: one line,
exit 2 unless it says otherwise), except the few that never reach a user as such: each of those
is converted where it is caught, and is named here with the reason."""
import importlib
import inspect
import pkgutil

import ds_trhash
from ds_trhash.errors import EXIT_USER_ERROR, UserError

# caught and converted where they are raised, never printed as themselves
INTERNAL = {
    "ds_trhash.checkpoints.sync_guard.LockHeld": "rotation defers, sync turns it into a SyncError",
    "ds_trhash.training.config.reading.DuplicateKeyError": "the YAML reader turns it into a ConfigError",
    "ds_trhash.eval.piqa.PiqaCountWarning": "a warning, not a refusal",
}


def _package_exceptions():
    for info in pkgutil.walk_packages(ds_trhash.__path__, "ds_trhash."):
        if ".hf." in info.name:  # the export's model code travels alone and imports nothing of ours
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module.__name__:
                yield f"{module.__name__}.{name}", obj


def test_every_package_error_is_a_user_error_or_named_as_internal():
    found = dict(_package_exceptions())
    assert len(found) > 30  # the walk reached the package's modules
    strays = sorted(name for name, cls in found.items() if not issubclass(cls, UserError) and name not in INTERNAL)
    assert strays == [], f"derive these from ds_trhash.errors.UserError (or name them in INTERNAL): {strays}"
    assert set(INTERNAL) <= set(found), "INTERNAL names a class that no longer exists"


def test_a_user_error_exits_2_unless_it_says_otherwise():
    assert UserError("x").exit_code == EXIT_USER_ERROR == 2

    class Diverged(UserError):
        exit_code = 1

    assert Diverged("y").exit_code == 1
