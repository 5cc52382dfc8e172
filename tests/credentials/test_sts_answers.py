"""What STS answers, read by botocore's parser and sorted into throttled / transient / denied.

Each answer is one STS sends for AssumeRole, in the Query protocol's error form
(``<ErrorResponse><Error><Type/><Code/><Message/></Error><RequestId/></ErrorResponse>``).
Codes and HTTP statuses are those of the STS API Reference, "AssumeRole: Errors"
(https://docs.aws.amazon.com/STS/latest/APIReference/API_AssumeRole.html#API_AssumeRole_Errors:
ExpiredToken 400, MalformedPolicyDocument 400, PackedPolicyTooLarge 400,
RegionDisabledException 403) and "Common Errors"
(https://docs.aws.amazon.com/STS/latest/APIReference/CommonErrors.html: InvalidClientTokenId
403, RequestExpired 400, InternalFailure 500, ServiceUnavailable 503, ThrottlingException /
Throttling 400, ValidationError 400), as botocore 1.44's STS model declares its own
(``sts/2011-06-15/service-2.json``: IDPCommunicationError 400); the message texts are the
ones the AWS CLI prints for them. The answers of a real moto with its signature check on
are in test_sts_requests.py, and the fault proxy's throttling answer in test_budget.py.

These pin behaviour the client had before issue 32 (same botocore parser); they fail if the
classification or the parsing drifts.
"""
from __future__ import annotations

from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kiamfast.control.iam.sts import StsClient, StsDenied, StsThrottled, StsTransient
from kiamfast.testing.background import BackgroundServer

ROLE = "arn:aws:iam::123456789012:role/team/app"


def error_xml(type_: str, code: str, message: str) -> bytes:
    return (f'<ErrorResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">'
            f"<Error><Type>{type_}</Type><Code>{code}</Code><Message>{message}</Message>"
            f"</Error><RequestId>c6104cbe-af31-11e0-8154-cbc7ccf896c7</RequestId>"
            f"</ErrorResponse>").encode()


class CannedSts(BackgroundServer):
    """Answers every POST on 127.0.0.1 with one status, content type and body."""

    def __init__(self):
        self.answer = (500, "text/xml", b"")
        self.url = ""

    def start(self):
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):  # noqa: N802 (http.server naming)
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, ctype, body = owner.answer
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        self._serve(server, name="canned-sts")
        return self


@pytest.fixture(scope="module")
def canned():
    with CannedSts() as server:
        yield server


@pytest.mark.parametrize("status, type_, code, message, kind", [
    (400, "Sender", "Throttling", "Rate exceeded", StsThrottled),
    (400, "Sender", "ThrottlingException", "Rate exceeded", StsThrottled),
    (403, "Sender", "AccessDenied",
     "User: arn:aws:sts::123456789012:assumed-role/node/i-0 is not authorized to perform: "
     "sts:AssumeRole on resource: " + ROLE, StsDenied),
    (403, "Sender", "RegionDisabledException",
     "STS is not activated in this region for account:123456789012. Your account "
     "administrator can activate STS in this region using the IAM Console.", StsDenied),
    (400, "Sender", "MalformedPolicyDocument", "Syntax errors in policy.", StsDenied),
    (400, "Sender", "PackedPolicyTooLarge",
     "Packed size of session tags and policies exceeds the limit by 12%", StsDenied),
    (400, "Sender", "ValidationError",
     "1 validation error detected: Value at 'roleArn' failed to satisfy constraint", StsDenied),
    (400, "Sender", "ExpiredToken", "The security token included in the request is expired",
     StsTransient),
    (403, "Sender", "InvalidClientTokenId",
     "The security token included in the request is invalid.", StsTransient),
    (403, "Sender", "SignatureDoesNotMatch",
     "The request signature we calculated does not match the signature you provided.",
     StsTransient),
    (400, "Sender", "RequestExpired", "Request has expired.", StsTransient),
    (400, "Sender", "IDPCommunicationError", "Couldn't reach the identity provider.",
     StsTransient),
    (500, "Receiver", "InternalFailure", "An internal error occurred", StsTransient),
    (503, "Receiver", "ServiceUnavailable", "Service is unavailable", StsTransient),
])
def test_an_sts_error_answer_is_sorted_by_its_code(canned, status, type_, code, message,
                                                   kind):
    canned.answer = (status, "text/xml", error_xml(type_, code, message))
    client = StsClient(endpoint_url=canned.url)
    try:
        with pytest.raises(kind) as info:
            client.assume_role_sync(ROLE, "n1")
    finally:
        client.close()
    err = info.value
    assert type(err) is kind
    assert (err.code, err.message, err.status, err.role_arn) == (code, message, status, ROLE)


@pytest.mark.parametrize("status, body, kind", [
    (503, b"<html><body>503 Service Temporarily Unavailable</body></html>", StsTransient),
    (502, b"", StsTransient),
])
def test_an_answer_that_is_no_sts_error_is_sorted_by_its_status(canned, status, body, kind):
    # A load balancer or proxy in the way answers in its own words (botocore reads a
    # 5xx it cannot parse by its status alone).
    canned.answer = (status, "text/html", body)
    client = StsClient(endpoint_url=canned.url)
    try:
        with pytest.raises(kind) as info:
            client.assume_role_sync(ROLE, "n1")
    finally:
        client.close()
    assert type(info.value) is kind and info.value.status == status


def test_a_success_without_credentials_is_transient(canned):
    canned.answer = (200, "text/xml", b'<AssumeRoleResponse xmlns="https://sts.amazonaws.com/'
                                      b'doc/2011-06-15/"><AssumeRoleResult/>'
                                      b"</AssumeRoleResponse>")
    client = StsClient(endpoint_url=canned.url)
    try:
        with pytest.raises(StsTransient) as info:
            client.assume_role_sync(ROLE, "n1")
    finally:
        client.close()
    assert info.value.code == "MalformedResponse"
