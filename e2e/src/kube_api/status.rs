//! The failures the server answers with: a `Status` object (kind Status, apiVersion v1,
//! status Failure) whose reason, message and details read as the real API server's.

use serde_json::{Value, json};

use super::resource::Resource;

#[derive(Debug)]
pub struct Failure {
    pub code: u16,
    reason: &'static str,
    message: String,
    details: Value,
}

impl Failure {
    fn new(code: u16, reason: &'static str, message: impl Into<String>, details: Value) -> Failure {
        Failure {
            code,
            reason,
            message: message.into(),
            details,
        }
    }

    pub fn to_json(&self) -> Value {
        let mut status = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                "message": self.message, "reason": self.reason, "code": self.code});
        if !self.details.is_null() {
            status["details"] = self.details.clone();
        }
        status
    }

    pub fn unauthorized() -> Failure {
        Failure::new(401, "Unauthorized", "Unauthorized", Value::Null)
    }

    /// RBAC's denial, worded as `forbiddenMessage` and `NewForbidden` word it.
    pub fn forbidden(
        user: &str,
        verb: &str,
        resource: &str,
        group: &str,
        namespace: Option<&str>,
        name: Option<&str>,
    ) -> Failure {
        let scope = match namespace {
            Some(ns) => format!("in the namespace {ns:?}"),
            None => "at the cluster scope".to_owned(),
        };
        let reason = format!(
            "User {user:?} cannot {verb} resource {resource:?} in API group {group:?} {scope}"
        );
        let qualified = if group.is_empty() {
            resource.to_owned()
        } else {
            format!("{resource}.{group}")
        };
        let message = match name {
            Some(n) => format!("{qualified} {n:?} is forbidden: {reason}"),
            None => format!("{qualified} is forbidden: {reason}"),
        };
        Failure::new(403, "Forbidden", message, details(resource, group, name))
    }

    pub fn not_found(resource: Resource, name: &str) -> Failure {
        Failure::new(
            404,
            "NotFound",
            format!("{} {name:?} not found", resource.qualified()),
            object_details(resource, name),
        )
    }

    /// A create of an object that exists.
    pub fn already_exists(resource: Resource, name: &str) -> Failure {
        Failure::new(
            409,
            "AlreadyExists",
            format!("{} {name:?} already exists", resource.qualified()),
            object_details(resource, name),
        )
    }

    /// A write the object's fields make invalid: `field` and what is wrong with it, as
    /// one cause (`NewInvalid` with one field error).
    pub fn invalid(
        resource: Resource,
        name: &str,
        field: &str,
        cause_reason: &str,
        detail: &str,
    ) -> Failure {
        let mut details = object_details(resource, name);
        details["kind"] = json!(resource.kind());
        details["causes"] = json!([{"reason": cause_reason, "message": detail, "field": field}]);
        Failure::new(
            422,
            "Invalid",
            format!(
                "{} {name:?} is invalid: {field}: {detail}",
                resource.qualified_kind()
            ),
            details,
        )
    }

    /// A path the server does not serve.
    pub fn no_such_path() -> Failure {
        Failure::new(
            404,
            "NotFound",
            "the server could not find the requested resource",
            json!({}),
        )
    }

    pub fn method_not_allowed() -> Failure {
        Failure::new(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
            json!({}),
        )
    }

    pub fn bad_request(message: impl Into<String>) -> Failure {
        Failure::new(400, "BadRequest", message, Value::Null)
    }

    /// A body that does not decode as an object of the resource (a malformed MicroTime,
    /// a wrong apiVersion), as the real server's decoder words it.
    pub fn undecodable(resource: Resource, cause: &str) -> Failure {
        Failure::bad_request(format!(
            "{} in version \"v1\" cannot be handled as a {}: {cause}",
            resource.kind(),
            resource.kind()
        ))
    }

    /// What the real server answers a create that carries a resourceVersion (its storage
    /// refuses it, and the error is not one the handler maps).
    pub fn internal(message: impl Into<String>) -> Failure {
        Failure::new(500, "InternalError", message, Value::Null)
    }

    /// 410 Gone for a resourceVersion older than the retained history.
    pub fn expired(message: String) -> Failure {
        Failure::new(410, "Expired", message, Value::Null)
    }

    /// A JSON patch that decoded but did not apply (a failed test, a missing path): the
    /// real server's generic 422 with the patch library's error as the cause.
    pub fn patch_not_applied(cause: String) -> Failure {
        Failure::new(
            422,
            "Invalid",
            "the server rejected our request due to an error in our request",
            json!({"causes": [{"reason": "UnexpectedServerResponse", "message": cause}]}),
        )
    }

    /// A write whose resourceVersion precondition no longer holds.
    pub fn conflict(resource: Resource, name: &str) -> Failure {
        Failure::conflict_because(
            resource,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        )
    }

    /// A 409 Conflict on the object for `cause` (`NewConflict`).
    pub fn conflict_because(resource: Resource, name: &str, cause: &str) -> Failure {
        Failure::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} {name:?}: {cause}",
                resource.qualified()
            ),
            object_details(resource, name),
        )
    }

    pub fn unsupported_patch(content_type: &str) -> Failure {
        Failure::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json (this test server does not implement {content_type})"
            ),
            Value::Null,
        )
    }

    pub fn payload_too_large() -> Failure {
        Failure::new(
            413,
            "RequestEntityTooLarge",
            "the request body is too large",
            Value::Null,
        )
    }
}

/// The Status of a successful DELETE of a resource whose storage does not answer with
/// the object: `details.kind` is the resource's plural, as the real server sets it.
pub fn deleted(resource: Resource, name: &str, uid: &Value) -> Value {
    let mut details = object_details(resource, name);
    details["uid"] = uid.clone();
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": details})
}

fn object_details(resource: Resource, name: &str) -> Value {
    details(resource.plural(), resource.group(), Some(name))
}

fn details(kind: &str, group: &str, name: Option<&str>) -> Value {
    let mut d = json!({"kind": kind});
    if !group.is_empty() {
        d["group"] = json!(group);
    }
    if let Some(n) = name {
        d["name"] = json!(n);
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forbidden_reads_as_rbac_says_it() {
        let f = Failure::forbidden(
            "system:serviceaccount:aether:agent",
            "patch",
            "nodes",
            "",
            None,
            Some("n1"),
        );
        assert_eq!(
            f.to_json(),
            json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": "Forbidden", "code": 403,
            "message": "nodes \"n1\" is forbidden: User \"system:serviceaccount:aether:agent\" cannot patch resource \"nodes\" in API group \"\" at the cluster scope",
            "details": {"name": "n1", "kind": "nodes"}})
        );
        let f = Failure::forbidden("u", "watch", "pods", "", Some("ns"), None);
        assert_eq!(
            f.to_json()["message"],
            "pods is forbidden: User \"u\" cannot watch resource \"pods\" in API group \"\" in the namespace \"ns\""
        );
        let f = Failure::forbidden(
            "u",
            "create",
            "tokenreviews",
            "authentication.k8s.io",
            None,
            None,
        );
        assert!(
            f.to_json()["message"]
                .as_str()
                .unwrap()
                .starts_with("tokenreviews.authentication.k8s.io is forbidden: ")
        );
    }
}
