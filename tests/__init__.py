"""The kvwire test suite, one folder per package of src/kvwire (helpers in tests/support)."""
