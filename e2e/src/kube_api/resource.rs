//! The resource types the server serves and what the API says of each: group, kind,
//! scope, the verbs served, the names kubectl knows it by. Routing, discovery, RBAC, the
//! store and the failure messages all read them from here, so that a resource is added
//! in one place.

/// The resource types the server stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Resource {
    Pods,
    Nodes,
    Services,
    EndpointSlices,
    Leases,
}

/// The agent only reads pods and nodes and patches nodes (its taint); writing them
/// otherwise is not implemented (a pod's graceful deletion is [`super::KubeApi`]'s job).
const READ_AND_PATCH: &[&str] = &["get", "list", "patch", "watch"];
/// What the mesh registrar and the tests write.
const READ_WRITE: &[&str] = &[
    "create", "delete", "get", "list", "patch", "update", "watch",
];

impl Resource {
    pub const ALL: [Resource; 5] = [
        Resource::Pods,
        Resource::Nodes,
        Resource::Services,
        Resource::EndpointSlices,
        Resource::Leases,
    ];

    pub fn plural(self) -> &'static str {
        match self {
            Resource::Pods => "pods",
            Resource::Nodes => "nodes",
            Resource::Services => "services",
            Resource::EndpointSlices => "endpointslices",
            Resource::Leases => "leases",
        }
    }

    pub fn kind(self) -> &'static str {
        match self {
            Resource::Pods => "Pod",
            Resource::Nodes => "Node",
            Resource::Services => "Service",
            Resource::EndpointSlices => "EndpointSlice",
            Resource::Leases => "Lease",
        }
    }

    /// The API group, "" for the core group.
    pub fn group(self) -> &'static str {
        match self {
            Resource::Pods | Resource::Nodes | Resource::Services => "",
            Resource::EndpointSlices => "discovery.k8s.io",
            Resource::Leases => "coordination.k8s.io",
        }
    }

    /// Objects' `apiVersion`: `v1` in the core group, `GROUP/v1` in the others (every
    /// resource here is served at v1 only).
    pub fn api_version(self) -> &'static str {
        match self {
            Resource::Pods | Resource::Nodes | Resource::Services => "v1",
            Resource::EndpointSlices => "discovery.k8s.io/v1",
            Resource::Leases => "coordination.k8s.io/v1",
        }
    }

    pub fn namespaced(self) -> bool {
        self != Resource::Nodes
    }

    /// The verbs served; any other is 405 Method Not Allowed (after RBAC, as on the real
    /// server).
    pub fn verbs(self) -> &'static [&'static str] {
        match self {
            Resource::Pods | Resource::Nodes => READ_AND_PATCH,
            Resource::Services | Resource::EndpointSlices | Resource::Leases => READ_WRITE,
        }
    }

    pub fn short_names(self) -> &'static [&'static str] {
        match self {
            Resource::Pods => &["po"],
            Resource::Nodes => &["no"],
            Resource::Services => &["svc"],
            Resource::EndpointSlices | Resource::Leases => &[],
        }
    }

    pub fn categories(self) -> &'static [&'static str] {
        match self {
            Resource::Pods | Resource::Services => &["all"],
            Resource::Nodes | Resource::EndpointSlices | Resource::Leases => &[],
        }
    }

    /// The resource as the real server's messages name it: `leases.coordination.k8s.io`,
    /// or the plural alone in the core group.
    pub fn qualified(self) -> String {
        match self.group() {
            "" => self.plural().to_owned(),
            group => format!("{}.{group}", self.plural()),
        }
    }

    /// The kind as validation messages name it: `Lease.coordination.k8s.io`, or the kind
    /// alone in the core group.
    pub fn qualified_kind(self) -> String {
        match self.group() {
            "" => self.kind().to_owned(),
            group => format!("{}.{group}", self.kind()),
        }
    }

    /// Whether DELETE answers with the deleted object, as the storage of pods and
    /// services does; the others answer with a Status of kind Success.
    pub fn delete_returns_object(self) -> bool {
        matches!(self, Resource::Pods | Resource::Services)
    }

    /// The resource of an RBAC rule or a test's `watchers` call, by its plural.
    pub fn from_plural(plural: &str) -> Option<Resource> {
        Resource::ALL.into_iter().find(|r| r.plural() == plural)
    }

    /// The resource a path names: `group` is "" under `/api/v1`.
    pub fn from_path(group: &str, plural: &str) -> Option<Resource> {
        Resource::from_plural(plural).filter(|r| r.group() == group)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_as_the_api_spells_them() {
        assert_eq!(Resource::Leases.qualified(), "leases.coordination.k8s.io");
        assert_eq!(Resource::Services.qualified(), "services");
        assert_eq!(
            Resource::EndpointSlices.qualified_kind(),
            "EndpointSlice.discovery.k8s.io"
        );
        assert_eq!(
            Resource::from_path("discovery.k8s.io", "endpointslices"),
            Some(Resource::EndpointSlices)
        );
        assert_eq!(
            Resource::from_path("", "endpointslices"),
            None,
            "not in the core group"
        );
        assert_eq!(Resource::from_path("coordination.k8s.io", "pods"), None);
        for r in Resource::ALL {
            assert_eq!(Resource::from_plural(r.plural()), Some(r));
            assert!(r.api_version().ends_with("v1") && r.api_version().starts_with(r.group()));
        }
    }
}
