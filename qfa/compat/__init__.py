"""Modules with other libraries' names and defaults, so code written for them runs on qfa."""
