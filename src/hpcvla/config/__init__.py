"""Typed, documented settings loaded from YAML with dotted command-line overrides."""

from hpcvla.config.loader import (ConfigError, config_argument, config_source,
                                  describe_settings, dump_config, last_run_config, load_config,
                                  resumed_run_config, seconds, whole_number,
                                  write_run_config)
from hpcvla.config.schema import Config

__all__ = ["Config", "ConfigError", "config_argument", "config_source", "describe_settings",
           "dump_config", "last_run_config", "load_config", "resumed_run_config", "seconds",
           "whole_number", "write_run_config"]
