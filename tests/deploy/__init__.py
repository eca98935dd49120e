"""Tests of the deployment: the container image, Kubernetes manifests, Prometheus and the
compose stack with its Grafana provisioning."""
