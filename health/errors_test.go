package health

import (
	"errors"
	"slices"
	"testing"
)

func TestFieldErrorsUnwrap(t *testing.T) {
	r := validReg()
	r.Port = 0
	err := r.Validate()
	var fe *FieldError
	if !errors.As(err, &fe) || fe.Field != "port" {
		t.Fatalf("errors.As: %v", err)
	}
	if !slices.Equal(Fields(fe), []string{"port"}) {
		t.Fatal("Fields of a single FieldError")
	}
}
