"""The control-plane protocol shared by the launcher and its workers: the store's keys, reached only through
launcher.wire.control.Control; the environment names a worker is started with (env); checkpoint folders (folders)."""
