"""The botocore session the STS client is built from, without what one STS call does not need
(issue 32): the 1.2 MB legacy ``endpoints.json`` (8 MiB, ~40 ms) and the loader's walk of every
service directory (~35 ms).  STS's endpoint rule set decides URL and signing region; the
legacy table only adds pseudo-regions (``aws-global``, ``us-east-1-fips``) and refuses some
dualstack hosts, so it is loaded as before for those."""
from __future__ import annotations

import glob
import os
import re
from collections.abc import Mapping
from typing import Any

_SERVICE_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")


def lean_loader(loader: Any) -> Any:
    """A botocore Loader with the same search paths as ``loader`` that answers the legacy
    endpoint table with an empty one when the table would come from botocore's own data
    (a table the user put in a ``data_path`` is loaded as before), and finds a service by
    its own directory."""
    import botocore.loaders

    class StsOnlyLoader(botocore.loaders.Loader):
        def list_available_services(self, type_name: str) -> Any:
            return _KnownServices(self, type_name)

        def load_data_with_path(self, name: str) -> Any:
            if name == "endpoints":
                for path in self.search_paths:
                    full = os.path.join(path, name)
                    if self.file_loader.exists(full):
                        if self.is_builtin_path(full):
                            return {"partitions": [], "version": 3}, full
                        break
            return super().load_data_with_path(name)

    return StsOnlyLoader(extra_search_paths=list(loader.search_paths),
                         include_default_search_paths=False)


class _KnownServices:
    """``name in services`` looks at that name's directories alone (botocore walks all ~450
    to answer it, ~17 ms a model type); iterated, it is botocore's own list."""

    def __init__(self, loader: Any, type_name: str):
        self._loader, self._type_name = loader, type_name

    def __contains__(self, name: object) -> bool:
        return (isinstance(name, str) and _SERVICE_NAME.match(name) is not None
                and any(glob.glob(os.path.join(path, name, "*", self._type_name + ".json*"))
                        for path in self._loader.search_paths))

    def __iter__(self) -> Any:
        import botocore.loaders
        return iter(botocore.loaders.Loader.list_available_services(self._loader,
                                                                     self._type_name))


def _in_a_partition(region: str, partitions: Mapping[str, Any]) -> bool:
    """A region of a partition by its name's form (``partitions.json``'s ``regionRegex``),
    which pseudo-regions such as ``aws-global`` do not have although that file lists them."""
    return any(re.match(p["regionRegex"], region) for p in partitions.get("partitions", []))


def sts_session(region: str) -> Any:
    """A botocore session that leaves the legacy endpoint table out where STS's rule set
    decides alone: a region of a known partition, no dualstack."""
    import botocore.session
    session = botocore.session.get_session()
    lean = lean_loader(session.get_component("data_loader"))
    if (not session.get_config_variable("use_dualstack_endpoint")
            and _in_a_partition(region, lean.load_data("partitions"))):
        session.register_component("data_loader", lean)
    return session


def assume_role_url(client: Any) -> str:
    """Where ``client`` sends AssumeRole, as its own endpoint resolution decides: a call
    stopped at its ``before-call`` event, before signing (nothing is sent)."""
    import botocore.awsrequest
    seen: list[str] = []

    def stop(params: dict, **_: Any) -> tuple[Any, dict]:
        seen.append(params["url"])
        return botocore.awsrequest.AWSResponse(params["url"], 200, {}, None), {}

    event = "before-call.sts.AssumeRole"
    client.meta.events.register_first(event, stop, unique_id="kiamfast-sts-url")
    try:
        client.assume_role(RoleArn="arn:aws:iam::123456789012:role/where",
                           RoleSessionName="where")
    finally:
        client.meta.events.unregister(event, unique_id="kiamfast-sts-url")
    return seen[0].removesuffix("/")
