"""Local stand-ins for Google Cloud REST APIs, for tests: shared plumbing and the Billing Catalog.

`JsonServer` is a threading HTTP server on 127.0.0.1 that answers JSON the way Google APIs do
(errors as `{"error": {"code", "message", "status"}}`) and, when given a public key, only
accepts requests whose bearer token is a JWT signed by the matching service-account key: the
real client libraries sign such self-signed JWTs locally, so no token server is needed.

`FakeBillingCatalog` serves `GET /v1/services` and `GET /v1/services/{id}/skus` of the Cloud
Billing Catalog API (v1) with page tokens, from SKUs the test gives it.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ALREADY_EXISTS",
    500: "INTERNAL",
    503: "UNAVAILABLE",
}


class ApiError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def service_account_info(project: str = "demo-project") -> tuple[dict[str, str], str]:
    """A fresh service-account key file (as a dict) and its public key in PEM."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    public = (
        key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )
    info = {
        "type": "service_account",
        "project_id": project,
        "private_key_id": "test-key",
        "private_key": private,
        "client_email": f"runner@{project}.iam.gserviceaccount.com",
        "client_id": "1",
        "token_uri": "http://127.0.0.1:9/token",  # never called: the clients sign JWTs locally
    }
    return info, public


class JsonServer:
    """Subclasses implement `handle(method, path, query, body) -> (status, json)`."""

    def __init__(self, public_key: str | None = None) -> None:
        self.public_key = public_key
        self.callers: list[str] = []
        """The `iss` of every accepted bearer token, in order."""
        self.lock = threading.RLock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server._serve(self, "GET")

            def do_POST(self) -> None:
                server._serve(self, "POST")

            def log_message(self, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def handle(
        self, method: str, path: str, query: dict[str, list[str]], body: dict
    ) -> tuple[int, dict]:
        raise NotImplementedError

    def _check_caller(self, header: str | None) -> None:
        if not header or not header.startswith("Bearer "):
            raise ApiError(401, "Request is missing required authentication credential.")
        if self.public_key is None:
            return
        from google.auth import jwt

        try:
            claims = jwt.decode(header[len("Bearer ") :], certs=self.public_key)
        except ValueError as exc:
            raise ApiError(401, f"Request had invalid authentication credentials: {exc}") from None
        self.callers.append(claims["iss"])

    def _serve(self, request: BaseHTTPRequestHandler, method: str) -> None:
        url = urlsplit(request.path)
        length = int(request.headers.get("Content-Length") or 0)
        raw = request.rfile.read(length) if length else b""
        try:
            with self.lock:
                self._check_caller(request.headers.get("Authorization"))
                body = json.loads(raw) if raw else {}
                status, reply = self.handle(method, url.path, parse_qs(url.query), body)
        except ApiError as err:
            status = err.code
            reply = {
                "error": {"code": err.code, "message": err.message, "status": STATUS[err.code]}
            }
        data = json.dumps(reply).encode()
        request.send_response(status)
        request.send_header("Content-Type", "application/json; charset=UTF-8")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)

    def start(self) -> None:
        threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


@contextmanager
def serving(server: JsonServer) -> Iterator[JsonServer]:
    server.start()
    try:
        yield server
    finally:
        server.close()


COMPUTE_ENGINE = ("6F81-5844-456A", "Compute Engine")
VERTEX_AI = ("C7E2-9256-1C43", "Vertex AI")


def sku(
    description: str,
    usd: float,
    *,
    usage_type: str = "OnDemand",
    group: str = "GPU",
    unit: str = "h",
    regions: tuple[str, ...] = ("us-central1", "us-east1", "us-west1"),
) -> dict[str, Any]:
    """One SKU in the shape `services.skus.list` returns it (USD price per `unit`)."""
    units, nanos = int(usd), round((usd - int(usd)) * 1e9)
    digest = hashlib.sha1(description.encode()).hexdigest().upper()
    sku_id = f"{digest[:4]}-{digest[4:8]}-{digest[8:12]}"
    return {
        "name": f"services/{COMPUTE_ENGINE[0]}/skus/{sku_id}",
        "skuId": sku_id,
        "description": description,
        "category": {
            "serviceDisplayName": COMPUTE_ENGINE[1],
            "resourceFamily": "Compute",
            "resourceGroup": group,
            "usageType": usage_type,
        },
        "serviceRegions": list(regions),
        "pricingInfo": [
            {
                "effectiveTime": "2026-11-29T08:00:00.000Z",
                "pricingExpression": {
                    "usageUnit": unit,
                    "displayQuantity": 1,
                    "tieredRates": [
                        {
                            "startUsageAmount": 0,
                            "unitPrice": {
                                "currencyCode": "USD",
                                "units": str(units),
                                "nanos": nanos,
                            },
                        }
                    ],
                    "usageUnitDescription": "hour" if unit == "h" else "gibibyte hour",
                    "baseUnit": "s" if unit == "h" else "By.s",
                    "baseUnitDescription": "second",
                    "baseUnitConversionFactor": 3600 if unit == "h" else 3865470566400,
                },
                "currencyConversionRate": 1,
            }
        ],
        "serviceProviderName": "Google",
        "geoTaxonomy": {"type": "MULTI_REGIONAL", "regions": list(regions)},
    }


class FakeBillingCatalog(JsonServer):
    """`services.list` and `services.skus.list`, paged `page_size` items at a time."""

    def __init__(
        self,
        skus: list[dict],
        *,
        public_key: str | None = None,
        page_size: int = 3,
        services: tuple[tuple[str, str], ...] = (
            ("95FF-2EF5-5EA1", "Cloud Storage"),
            VERTEX_AI,
            COMPUTE_ENGINE,
        ),
    ) -> None:
        super().__init__(public_key)
        self.skus = skus
        self.page_size = page_size
        self.services = services
        self.requests: list[tuple[str, dict[str, list[str]]]] = []

    def _page(self, items: list[dict], query: dict[str, list[str]]) -> tuple[list[dict], str]:
        start = int(query.get("pageToken", ["0"])[0] or 0)
        size = min(int(query.get("pageSize", [str(self.page_size)])[0]), self.page_size)
        end = start + size
        return items[start:end], (str(end) if end < len(items) else "")

    def handle(
        self, method: str, path: str, query: dict[str, list[str]], body: dict
    ) -> tuple[int, dict]:
        self.requests.append((path, query))
        if method != "GET":
            raise ApiError(404, f"no {method} {path}")
        if path == "/v1/services":
            listed = [
                {
                    "name": f"services/{sid}",
                    "serviceId": sid,
                    "displayName": name,
                    "businessEntityName": "businessEntities/GCP",
                }
                for sid, name in self.services
            ]
            page, token = self._page(listed, query)
            return 200, {"services": page, "nextPageToken": token}
        parts = path.split("/")
        if len(parts) == 5 and parts[:3] == ["", "v1", "services"] and parts[4] == "skus":
            if parts[3] != COMPUTE_ENGINE[0]:
                return 200, {"skus": [], "nextPageToken": ""}
            currency = query.get("currencyCode", ["USD"])[0]
            if currency != "USD":
                raise ApiError(400, f"currency {currency} is not served here")
            page, token = self._page(self.skus, query)
            return 200, {"skus": page, "nextPageToken": token}
        raise ApiError(404, f"no {method} {path}")
