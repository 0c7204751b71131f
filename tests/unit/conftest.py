"""The Megatron-Core reference runner, for unit tests outside tests/unit/data as well."""
from tests.unit.data.conftest import megatron_core  # noqa: F401
