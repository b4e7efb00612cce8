"""The control-plane protocol shared by the launcher and its workers: store keys, environment names and
checkpoint folders, reached through launcher.wire.control.Control."""
