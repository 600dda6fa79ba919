package apitypes

// ErrorBody is every error answer: {"error": {"code": ..., "message": ...}}, with the
// HTTP status of its code (docs/API.md, "Errors"). A streamed exec's error event
// carries one too (StreamEvent.Error).
type ErrorBody struct {
	Error ErrorDetail `json:"error"`
}

// ErrorDetail is the inner object of an error: Code is invalid, forbidden, not_found, conflict,
// unavailable or internal; Message says what to do. A streamed import's error line
// carries it alone (ImportEvent.Error).
type ErrorDetail struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}
