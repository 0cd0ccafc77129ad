"""Calibration recipes shipped as package data (YAML files beside this module)."""
