"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from fastapi.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    """An error answered to the client with ``status`` and an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, dict[str, str | int | None]]:
        """The JSON body."""
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(
                    self.status, "invalid_request_error" if self.status < 500 else "server_error"
                ),
                "param": self.param,
                "code": self.code or self.status,
            }
        }

    def response(self) -> JSONResponse:
        """The HTTP response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)
