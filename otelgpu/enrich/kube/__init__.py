"""The Kubernetes API as a source of pod, namespace and node facts."""
