"""elasticd's Grafana dashboard and Prometheus alert rules, generated from code.

``python -m grafana.generate`` writes ``grafana/elasticd.json`` (the dashboard) and ``grafana/alerts.yaml`` (the
rules) from :mod:`grafana.panels` (what the dashboard shows), :mod:`grafana.dashboard` (how it is built) and
:mod:`grafana.alerts`. The tests regenerate both and compare, run every expression on a real Prometheus, and
validate the dashboard against Grafana's schema. docs/operations.md explains each panel and alert.
"""
