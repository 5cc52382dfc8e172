"""The injection webhook (``kiamfast webhook``): a Deployment of its own, called by the API
server for pod creations, never imported by the agent's processes.

* `cli.py`: its flags and start;
* `server.py`: the HTTPS server and its bounds against any pod that reaches its Service;
* `tls.py`: the serving certificate, reloaded when its files change;
* `admission.py`: the AdmissionReview answer (always allowed);
* `patch.py`: the JSONPatch of an opting-in pod (pure);
* `accounts.py`: the annotations of a pod's ServiceAccount, read briefly cached.

docs/architecture.md, "The injection webhook", says what it does and why.
"""
