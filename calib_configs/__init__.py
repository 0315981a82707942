"""Calibration presets (``NAME.yaml``), installed as ``resserve_export.calib_configs``: read them
through :func:`resserve_export.calibrate.load_preset` (``--config NAME``)."""
