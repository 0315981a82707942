from tests.fixtures.families import families  # noqa: F401 (session fixture: tiny models of every adapter family)
