"""Control logic shared by the operator and local mode, pure (no I/O, no clock of its own).

From the API resources to the desired state of a pool: the planners' inputs (``inputs``), SeaLLM
placement with its estimator (``placement``), the pool plan with its problems (``pool_plan``), the
objects the operator owns with their names and labels (``children``), and the Prometheus queries
over the workers' metrics with their results parsed (``metrics_queries``).
"""
