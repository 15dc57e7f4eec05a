package health

import (
	"errors"
	"fmt"
	"strings"
)

// FieldError reports one invalid field of a registration or configuration.
// Callers branch on it with errors.As to name the offending field to a user.
type FieldError struct {
	Field  string // e.g. "instance_id", "label_zone", "capacity"
	Value  string // the rejected value, truncated for display
	Reason string
}

func (e *FieldError) Error() string {
	if e.Value == "" {
		return fmt.Sprintf("%s: %s", e.Field, e.Reason)
	}
	return fmt.Sprintf("%s %q: %s", e.Field, e.Value, e.Reason)
}

// fieldErr builds a FieldError, truncating long values so errors stay readable.
func fieldErr(field, value, format string, args ...any) *FieldError {
	const maxShown = 64
	if len(value) > maxShown {
		value = value[:maxShown] + "…"
	}
	return &FieldError{Field: field, Value: value, Reason: fmt.Sprintf(format, args...)}
}

// FieldErrors collects every invalid field so a user fixes them in one go.
type FieldErrors []*FieldError

func (es FieldErrors) Error() string {
	parts := make([]string, len(es))
	for i, e := range es {
		parts[i] = e.Error()
	}
	return "invalid " + strings.Join(parts, "; ")
}

// Unwrap lets errors.As find each FieldError.
func (es FieldErrors) Unwrap() []error {
	out := make([]error, len(es))
	for i, e := range es {
		out[i] = e
	}
	return out
}

// err returns nil for an empty list, so `return errs.err()` is safe.
func (es FieldErrors) err() error {
	if len(es) == 0 {
		return nil
	}
	return es
}

// Fields lists the names of the invalid fields in err (empty when err holds none).
func Fields(err error) []string {
	var out []string
	var many FieldErrors
	if errors.As(err, &many) {
		for _, e := range many {
			out = append(out, e.Field)
		}
		return out
	}
	var one *FieldError
	if errors.As(err, &one) {
		out = append(out, one.Field)
	}
	return out
}
