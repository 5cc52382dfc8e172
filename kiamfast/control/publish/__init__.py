"""Publishing what the control process decided: the table's address entries and status words
(``addresses``), the aux blobs workers serve (``aux``: /metrics, /healthz, /debug/store,
denials), and the control process's own metrics (``metrics``)."""
